"""The gateway's side of structured output and tools, without a service: which constraint a
request asks for, the grammars of forced calls, and the parsers that find calls in a model's
text, whole or streamed in pieces of any size."""

from __future__ import annotations

import json

import msgspec
import pytest

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.request_types import ChatCompletionRequest, CompletionRequest
from turnstile.gateway_svc.structured_output import grammar_of
from turnstile.gateway_svc.tool_calls import CallReader, forced_call, template_message, tool_mode
from turnstile.shared.protocol import Grammar

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}  # fmt: skip


def chat(**fields: object) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)


def completion(**fields: object) -> CompletionRequest:
    return msgspec.json.decode(msgspec.json.encode({"prompt": "Hi", **fields}),
                               type=CompletionRequest)  # fmt: skip


def test_each_field_becomes_its_grammar() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert grammar_of(completion()) is None
    assert grammar_of(completion(response_format={"type": "text"})) is None
    assert grammar_of(completion(response_format={"type": "json_object"})) == (
        "response_format", Grammar("json"))  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert grammar_of(chat(response_format=fmt)) == (
        "response_format", Grammar("json", json.dumps(schema)))  # fmt: skip
    assert grammar_of(completion(guided_json=json.dumps(schema))) == (
        "guided_json", Grammar("json", json.dumps(schema)))  # fmt: skip
    compact = {"json": schema, "disable_any_whitespace": True}
    spaced = Grammar("json", json.dumps(schema), any_whitespace=False)
    assert grammar_of(completion(structured_outputs=compact)) == ("structured_outputs", spaced)
    assert grammar_of(completion(structured_outputs={"regex": "a+"})) == (
        "structured_outputs", Grammar("regex", "a+"))  # fmt: skip
    assert grammar_of(completion(guided_choice=['say "x"', "b"])) == (
        "guided_choice", Grammar("ebnf", 'root ::= "say \\"x\\"" | "b"'))  # fmt: skip


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (completion(guided_regex="a", response_format={"type": "json_object"}), "response_format"),
        (completion(structured_outputs={}), "structured_outputs"),
        (completion(guided_json="[1, 2]"), "guided_json"),
    ],
)
def test_conflicting_or_empty_constraints_are_refused(request_: CompletionRequest,
                                                      param: str) -> None:  # fmt: skip
    with pytest.raises(ApiError) as refusal:
        grammar_of(request_)
    assert refusal.value.param == param


def test_tool_choice_modes_and_their_refusals() -> None:
    assert tool_mode(chat(), None) is None
    assert tool_mode(chat(tools=[TOOL], tool_choice="none"), None) is None
    assert tool_mode(chat(tools=[TOOL], tool_choice="required"), None) == "required"
    named = {"type": "function", "function": {"name": "add"}}
    assert tool_mode(chat(tools=[TOOL], tool_choice=named), None) == "named"
    assert tool_mode(chat(tools=[TOOL]), "hermes") == "auto"  # vLLM's default with tools
    for request, parser in [
        (chat(tools=[TOOL]), None),  # auto needs --enable-auto-tool-choice
        (chat(tool_choice="required"), "hermes"),  # no tools to call
        (chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "x"}}), None),
    ]:
        with pytest.raises(ApiError) as refusal:
            tool_mode(request, parser)
        assert refusal.value.param == "tool_choice"


def test_forced_calls_are_json_schemas_of_the_tools() -> None:
    named = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "add"}})
    assert json.loads(forced_call(named, "named").spec) == TOOL["function"]["parameters"]
    single = chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(forced_call(single, "required").spec)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    call = schema["items"]["anyOf"][0]["properties"]
    assert call["name"] == {"const": "add"}
    assert call["parameters"] == TOOL["function"]["parameters"]
    assert forced_call(chat(tools=[TOOL], tool_choice="none"), None) is None


def test_an_assistant_calls_arguments_reach_the_template_as_objects() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    message = template_message({"role": "assistant", "content": "", "tool_calls": [call]})
    assert message["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    with pytest.raises(ApiError):
        template_message({"role": "assistant", "tool_calls": [
            {"function": {"name": "add", "arguments": "{oops"}}]})  # fmt: skip


def read(reader: CallReader, text: str, size: int) -> tuple[str, list[tuple[str, dict]], str]:
    """`text` streamed in pieces of `size` characters (0: whole)."""
    if size == 0:
        said, calls, reason = reader.whole(text, "stop")
    else:
        said, calls, reason = "", [], None
        pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
        for k, piece in enumerate(pieces):
            more, found, reason = reader.step(piece, "stop" if k == len(pieces) - 1 else None)
            said, calls = said + more, calls + found
        assert [c["index"] for c in calls] == list(range(len(calls)))
    parsed = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    return said, parsed, reason  # type: ignore[return-value]


HERMES = [
    ("Let me add. <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>"
     "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 2}}</tool_call>",
     ("Let me add. ", [("add", {"a": 1}), ("add", {"a": 2})], "tool_calls")),
    ("No call here, only <tool text.", ("No call here, only <tool text.", [], "stop")),
    ("<tool_call>{not json}</tool_call>", ("<tool_call>{not json}</tool_call>", [], "stop")),
    ('<tool_call>{"name": "add", "arguments": {"a": 3}}', ("", [("add", {"a": 3})], "tool_calls")),
]  # fmt: skip
LLAMA3 = [
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {}}',
     ("", [("add", {"a": 1}), ("add", {})], "tool_calls")),
    ("The answer is {42}.", ("The answer is {42}.", [], "stop")),
    ('{"name": "add", "parameters": {"a": 1}} and more', (
        '{"name": "add", "parameters": {"a": 1}} and more', [], "stop")),
]  # fmt: skip


@pytest.mark.parametrize("size", [0, 1, 3, 7, 1000])
@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [("hermes", *case) for case in HERMES] + [("llama3_json", *case) for case in LLAMA3],
)
def test_parsers_find_the_same_calls_whole_or_streamed(
    parser: str, text: str, expected: tuple, size: int
) -> None:
    assert read(CallReader("auto", parser), text, size) == expected


@pytest.mark.parametrize("size", [0, 2])
def test_forced_calls_are_read_from_their_json(size: int) -> None:
    required = '[{"name": "add", "parameters": {"a": 1}}, {"name": "add", "parameters": {"a": 2}}]'
    assert read(CallReader("required", None), required, size) == (
        "", [("add", {"a": 1}), ("add", {"a": 2})], "tool_calls")  # fmt: skip
    assert read(CallReader("named", None, "add"), '{"a": 5}', size) == (
        "", [("add", {"a": 5})], "stop")  # fmt: skip


def test_tools_and_tool_messages_reach_the_chat_template() -> None:
    import dataclasses

    from turnstile.gateway_svc.openai_api import chat_text
    from turnstile.shared.model_info import embedded_model_path, read_model_info
    from turnstile.shared.tokenizer import Tokenizer

    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}({{ c.function.name }} a={{ c.function.arguments.a }})"
        "{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}"
    )
    model = embedded_model_path()
    tokenizer = Tokenizer(model, dataclasses.replace(read_model_info(model),
                                                     chat_template=template))  # fmt: skip
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    request = chat(tools=[TOOL], tool_choice="none", messages=[
        {"role": "user", "content": "Add"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ])  # fmt: skip
    assert chat_text(request, tokenizer) == "[add]<user>Add<assistant>(add a=2)<tool>3#c1"
