"""Anthropic's Messages API (`/v1/messages`, as vLLM serves it) through the official `anthropic`
client on the shared stack: a message whole and streamed alike, a system prompt, stop sequences
and max_tokens as stop reasons, tool_use blocks (whole and streamed) and a tool_result turn
after them, count_tokens, and what is not served refused in Anthropic's error shape."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from conftest import MODEL

from turnstile.bench.server_process import Server

pytestmark = pytest.mark.slow  # uses the shared stack

GREEDY = {"temperature": 0}  # the SDK no longer sends it; the API takes it
ASK = [{"role": "user", "content": "Name a colour."}]
WEATHER = {
    "name": "get_weather", "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]},
}  # fmt: skip
FORCED = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def claude(service: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=service.url, api_key="unused", max_retries=0)


def test_a_message_whole_and_streamed_alike_under_its_system_prompt(
    claude: anthropic.Anthropic, client: openai.OpenAI
) -> None:
    args: dict[str, Any] = dict(model=MODEL, max_tokens=24, system="Be brief.", messages=ASK,
                                extra_body=GREEDY)  # fmt: skip
    whole = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert [block.type for block in whole.content] == ["text"]
    assert whole.content[0].text == text == streamed.content[0].text != ""
    assert whole.stop_reason == streamed.stop_reason in ("end_turn", "max_tokens")
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *ASK], max_tokens=24,
        temperature=0,
    )  # fmt: skip
    assert whole.content[0].text == chat.choices[0].message.content  # the same chat
    usage = whole.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == streamed.usage.output_tokens == chat.usage.completion_tokens
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_stop_sequences_and_max_tokens_are_its_stop_reasons(claude: anthropic.Anthropic) -> None:
    counting = [{"role": "user", "content": "Count from one to ten in words, with commas."}]
    free = claude.messages.create(model=MODEL, max_tokens=40, messages=counting, extra_body=GREEDY)
    text = free.content[0].text
    assert "," in text
    stopped = claude.messages.create(
        model=MODEL, max_tokens=40, messages=counting, stop_sequences=["nothing like it", ","],
        extra_body=GREEDY,
    )  # fmt: skip
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", ",")
    assert stopped.content[0].text == text[: text.index(",")]
    short = claude.messages.create(model=MODEL, max_tokens=2, messages=counting, extra_body=GREEDY)
    assert (short.stop_reason, short.usage.output_tokens) == ("max_tokens", 2)


def test_a_forced_tool_is_a_tool_use_block_and_its_result_goes_back(
    claude: anthropic.Anthropic,
) -> None:
    args: dict[str, Any] = dict(model=MODEL, max_tokens=60, tools=[WEATHER], tool_choice=FORCED,
                                messages=[{"role": "user", "content": "Weather in Paris?"}],
                                extra_body=GREEDY)  # fmt: skip
    whole = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "tool_use"
        (use,) = [block for block in message.content if block.type == "tool_use"]
        assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
    (use,) = [block for block in whole.content if block.type == "tool_use"]
    turn = [
        *args["messages"],
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                           "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "Sunny, 24 C"}]},
    ]  # fmt: skip
    answer = claude.messages.create(model=MODEL, max_tokens=16, messages=turn, extra_body=GREEDY)
    assert answer.content[0].type == "text"
    prompt = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    with_result = claude.messages.count_tokens(model=MODEL, messages=turn).input_tokens
    without = claude.messages.count_tokens(model=MODEL, messages=turn[:-1]).input_tokens
    assert prompt == with_result > without + 5  # the result's text is in the prompt


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "image block is not supported"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": 5}]}]},
         "content[0].content: must be a string or text blocks"),
        ({"temperature": 1.5}, "temperature"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "needs its name"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_refused_in_anthropics_shape(
    claude: anthropic.Anthropic, fields: dict[str, Any], named: str
) -> None:
    request = {"model": MODEL, "max_tokens": 8, "messages": ASK, **fields}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.post("/v1/messages", cast_to=object, body=request)
    body = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert named in body["error"]["message"]
