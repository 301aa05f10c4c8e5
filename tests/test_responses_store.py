"""Stored responses (`--responses-store-size`), through the running service and the official
client: a kept response is read back (`client.responses.retrieve`) and continued
(`previous_response_id`: its conversation, its own instructions left behind, as OpenAI's, then
the new input), calls and their outputs included; `store: false` keeps nothing; the oldest are
forgotten past the size; a deleted one is gone. Without the flag both fields are refused
(`test_responses_api.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from conftest import MODEL
from test_responses_tools import ADD, NAMED, as_chat_tool

from turnstile.bench.server_process import Server, launched_server

pytestmark = pytest.mark.slow  # starts a stack

SIZE = 3
FIRST, SECOND = "My name is Ada. Say hello.", "What is my name?"
FIELDS = {"model": MODEL, "temperature": 0, "max_output_tokens": 8}


@pytest.fixture(scope="module")
def service() -> Iterator[Server]:
    with launched_server("--num-blocks", "256", "--responses-store-size", str(SIZE)) as running:
        yield running


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **fields: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8, **fields
    )


def test_a_kept_response_is_read_back_and_continued(client: openai.OpenAI) -> None:
    first = client.responses.create(**FIELDS, input=FIRST, instructions="Be brief.")
    assert first.store is True
    kept = client.responses.retrieve(first.id)
    assert kept.id == first.id and kept.output_text == first.output_text
    second = client.responses.create(**FIELDS, input=SECOND, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    same = chat(client, [{"role": "user", "content": FIRST},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": SECOND}])  # fmt: skip
    assert second.usage.input_tokens == same.usage.prompt_tokens  # no "Be brief." carried over
    assert second.output_text == same.choices[0].message.content


def test_a_streamed_response_is_kept_as_it_finished(client: openai.OpenAI) -> None:
    events = list(client.responses.create(**FIELDS, input=FIRST, stream=True))
    done = events[-1].response
    kept = client.responses.retrieve(done.id)
    assert kept.status == done.status and kept.output_text == done.output_text


def test_a_call_and_its_output_continue_the_conversation(client: openai.OpenAI) -> None:
    asked = client.responses.create(**FIELDS | {"max_output_tokens": 40}, input="2 plus 3?",
                                    tools=[ADD], tool_choice=NAMED)  # fmt: skip
    (call,) = asked.output
    answer = client.responses.create(
        **FIELDS, previous_response_id=asked.id, tools=[ADD], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
    )  # fmt: skip
    same = chat(client, [
        {"role": "user", "content": "2 plus 3?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id,
         "type": "function", "function": {"name": "add", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "5"},
    ], tools=[as_chat_tool(ADD)], tool_choice="none")  # fmt: skip
    assert answer.usage.input_tokens == same.usage.prompt_tokens
    assert answer.output_text == same.choices[0].message.content


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(**FIELDS, input=FIRST, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(response.id)
    assert missing.value.body["param"] == "response_id"


def test_the_oldest_are_forgotten_and_a_deleted_one_is_gone(client: openai.OpenAI) -> None:
    ids = [client.responses.create(**FIELDS, input=f"Count to {i}.").id for i in range(SIZE + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(**FIELDS, input=SECOND, previous_response_id=ids[0])
    assert missing.value.body["param"] == "previous_response_id"
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    client.responses.delete(ids[1])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(ids[1])
