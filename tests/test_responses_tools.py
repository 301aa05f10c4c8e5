"""Function tools in OpenAI's Responses API, through the running service and the official client:
a forced call is a `function_call` output item with the chat's arguments, whole and as its
stream's events; a later turn's `function_call` and `function_call_output` items are the chat's
assistant calls and tool message; what the server cannot do with tools is refused by name. (The
135M model does not call tools by itself: calls here are forced, "required" or named, whose
grammar makes them; "auto" is the chat's parser, `test_structured_output.py`.)"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from conftest import MODEL

pytestmark = pytest.mark.slow  # starts a stack

ADD = {"type": "function", "name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                      "b": {"type": "integer"}}, "required": ["a", "b"],
                      "additionalProperties": False}}  # fmt: skip
LOUDER = {"type": "function", "name": "louder",
          "parameters": {"type": "object", "properties": {"text": {"type": "string",
                         "maxLength": 12}}, "required": ["text"]}}  # fmt: skip
QUESTION = "What is 2 plus 3?"
NAMED = {"type": "function", "name": "add"}
BAD_CALL = {"type": "function_call", "call_id": "c", "name": "add", "arguments": "{not json"}
FIELDS = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 40}


def as_chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def test_a_named_call_is_a_function_call_item_with_the_chats_arguments(
    client: openai.OpenAI,
) -> None:
    response = client.responses.create(**FIELDS, tools=[ADD, LOUDER], tool_choice=NAMED)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "add" and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"a", "b"}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=40, tools=[as_chat_tool(ADD), as_chat_tool(LOUDER)],
        tool_choice={"type": "function", "function": {"name": "add"}},
    )  # fmt: skip
    (same,) = chat.choices[0].message.tool_calls
    assert call.arguments == same.function.arguments
    assert response.usage.input_tokens == chat.usage.prompt_tokens  # the tools in the prompt
    assert response.tools[0].name == "add" and response.tool_choice.name == "add"


def test_required_without_parallel_calls_is_one_call(client: openai.OpenAI) -> None:
    response = client.responses.create(
        **FIELDS | {"max_output_tokens": 100}, tools=[ADD, LOUDER], tool_choice="required",
        parallel_tool_calls=False,
    )  # fmt: skip
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name in {"add", "louder"}
    assert response.parallel_tool_calls is False


def test_a_streamed_call_is_its_items_events(client: openai.OpenAI) -> None:
    whole = client.responses.create(**FIELDS, tools=[ADD], tool_choice=NAMED)
    events = list(client.responses.create(**FIELDS, tools=[ADD], tool_choice=NAMED, stream=True))
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    (call,) = whole.output
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert events[3].delta == events[4].arguments == call.arguments
    assert events[5].item.call_id and events[5].item.arguments == call.arguments
    assert events[-1].response.output[0].arguments == call.arguments
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_a_later_turn_brings_the_calls_and_their_outputs(client: openai.OpenAI) -> None:
    """Two calls in a row are one assistant message's calls, as a chat holds them."""
    arguments = ['{"a": 2, "b": 3}', '{"a": 5, "b": 1}']
    calls = [{"type": "function_call", "call_id": f"call_{i}", "name": "add", "arguments": a}
             for i, a in enumerate(arguments)]  # fmt: skip
    outputs = [{"type": "function_call_output", "call_id": f"call_{i}", "output": o}
               for i, o in enumerate(["5", "6"])]  # fmt: skip
    response = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": QUESTION}, *calls, *outputs],
        tools=[ADD], tool_choice="none", temperature=0, max_output_tokens=12,
    )  # fmt: skip
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": a}}
            for i, a in enumerate(arguments)]},
        *({"role": "tool", "tool_call_id": f"call_{i}", "content": o}
          for i, o in enumerate(["5", "6"])),
    ]  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[as_chat_tool(ADD)], tool_choice="none",
        temperature=0, max_tokens=12,
    )  # fmt: skip
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content
    assert [item.type for item in response.output] == ["message"]


def test_auto_without_tools_is_a_plain_answer(client: openai.OpenAI) -> None:
    response = client.responses.create(**FIELDS, tool_choice="auto")
    assert [item.type for item in response.output] == ["message"] and response.output_text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [ADD]}, "tool_choice"),  # "auto" (the default) needs the server's parser
        ({"tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"input": [BAD_CALL]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
    ],
)
def test_what_the_tools_cannot_do_is_refused_by_name(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refusal:
        client.post("/responses", cast_to=object, body=FIELDS | fields)
    assert refusal.value.body["param"] == param
