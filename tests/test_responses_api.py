"""OpenAI's Responses API through the running service and the official openai client
(`client.responses`): a response is the chat it runs as, whole and as its stream of events;
text formats constrain it; what a stateless server cannot do is refused by name. Function tools:
`test_responses_tools.py`."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from conftest import MODEL

pytestmark = pytest.mark.slow  # starts a stack

INSTRUCTIONS = "Answer in a few words."
QUESTION = "Name three colours of the rainbow."


def chat(client: openai.OpenAI, messages: list[dict[str, str]], **fields: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **fields)


def test_a_response_is_its_chats_answer(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=12,
        temperature=0,
    )  # fmt: skip
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    same = chat(client, messages, max_tokens=12)
    assert response.output_text == same.choices[0].message.content and response.output_text
    assert response.usage.input_tokens == same.usage.prompt_tokens
    assert response.usage.output_tokens == same.usage.completion_tokens
    cut = same.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details is not None) == cut
    assert response.id.startswith("resp_") and response.output[0].role == "assistant"


def test_input_messages_with_text_parts_and_an_earlier_answer(client: openai.OpenAI) -> None:
    turns = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi! "},
                                     {"type": "input_text", "text": QUESTION}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Red, green"}]},
        {"role": "user", "content": "And one more?"},
    ]  # fmt: skip
    response = client.responses.create(model=MODEL, input=turns, max_output_tokens=8,
                                        temperature=0)  # fmt: skip
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "Hi! " + QUESTION},
        {"role": "assistant", "content": "Red, green"},
        {"role": "user", "content": "And one more?"},
    ]
    same = chat(client, messages, max_tokens=8)
    assert response.output_text == same.choices[0].message.content
    assert response.usage.input_tokens == same.usage.prompt_tokens  # the same prompt, templated


def test_a_streamed_response_is_its_events_in_order(client: openai.OpenAI) -> None:
    fields = dict(model=MODEL, input=QUESTION, max_output_tokens=10, temperature=0)
    whole = client.responses.create(**fields)
    events = list(client.responses.create(**fields, stream=True))
    kinds = [event.type for event in events]
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]  # fmt: skip
    tail = ["response.output_text.done", "response.content_part.done",
            "response.output_item.done", f"response.{whole.status}"]  # fmt: skip
    assert kinds[:4] == head and kinds[-4:] == tail
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events[4:-4])
    assert text == whole.output_text == events[-4].text
    assert events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_json_schema_format_constrains_the_text(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}  # fmt: skip
    response = client.responses.create(
        model=MODEL, input="Your favourite colour, as JSON.", temperature=0,
        max_output_tokens=40, text={"format": {"type": "json_schema", "name": "favourite",
                                               "schema": schema, "strict": True}},
    )  # fmt: skip
    answer = json.loads(response.output_text)
    assert set(answer) == {"colour"} and isinstance(answer["colour"], str)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
        ({"input": [{"type": "reasoning", "summary": [],
                     "content": [{"type": "reasoning_text", "text": 3}]}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"temprature": 0}, "temprature"),
    ],
)  # fmt: skip
def test_what_a_stateless_text_server_cannot_do_is_refused_by_name(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4} | fields
    with pytest.raises(openai.BadRequestError) as refusal:
        client.post("/responses", cast_to=object, body=body)
    assert refusal.value.body["param"] == param
