"""Answers as models write their tool calls, by `--tool-call-parser`, for
`bench/tool_parsers_vs_vllm.sh`, which reads each through vLLM's parser of that name and
Turnstile's: the calls found and the text left must agree."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

_ADD = {"a": {"type": "integer"}, "b": {"type": "string"}}
_WEATHER = {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
            "tags": {"type": "array"}, "opts": {"type": "object"}, "temp": {"type": "number"},
            "note": {"type": ["string", "null"]}, "unit": {"enum": ["c", "f"]},
            "when": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object",
                                                                  "properties": properties}}}
    for name, properties in (("add", _ADD), ("weather", _WEATHER))
]  # fmt: skip


def _xml(name: str, **values: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


# Every argument of `weather` as a model writes it, and text before two calls of `add`.
_WEATHER_TEXT = {"city": "Paris", "days": "3", "metric": "true", "tags": '["a", "b"]',
                 "opts": '{"x": 1}', "temp": "2.5", "note": "null", "unit": "c",
                 "when": "7"}  # fmt: skip


def _two_adds(call: Callable[..., str]) -> str:
    return "Let me check.\n" + call("add", a="7", b=" 12 ") + "\n" + call("add", a="seven")


def _glm(name: str, **values: str) -> str:
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in values.items()
    )
    return f"<tool_call>{name}\n{pairs}</tool_call>"


_GLM = [
    _glm("weather", **_WEATHER_TEXT | {"opts": "{'x': 1}"}),
    _two_adds(_glm),
    _glm("weather", metric="True", note="None", tags="('a', 1)", days=" 2 "),
    "<tool_call>add</tool_call>",
    _glm("unknown", q="5"),
    "<tool_call>weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",
    "No tools needed.",
]
TEXTS = {
    "glm45": _GLM,
    "glm47": _GLM,
    "granite": [
        '<|tool_call|>[{"name": "add", "arguments": {"a": 1}}]',
        'I will check. <tool_call>[{"name": "add", "arguments": {"a": 1}}, {"name": "weather", '
        '"arguments": {"city": "Oslo"}}]',
        "No call here.",
        "<tool_call>[not json]",
    ],
    "hermes": [
        'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>\n<tool_call>'
        '{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>',
        "No call here, only <tool text.",
        "<tool_call>{not json}</tool_call>",
    ],
    "llama3_json": [
        '{"name": "add", "parameters": {"a": 1}}',
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "weather", '
        '"parameters": {"city": "Oslo"}}',
        "The answer is {42}.",
    ],
    "mistral": [
        'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": "x"}}]',
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "weather", '
        '"arguments": {"city": "Oslo"}}]',
        '[TOOL_CALLS]add{"a": 2}',
        '[TOOL_CALLS]add[ARGS]{"a": 3}[TOOL_CALLS]weather[ARGS]{"city": "Paris"}',
        "No call at all.",
        "[TOOL_CALLS]not json",
    ],
    "phi4_mini_json": [
        'functools[{"name": "add", "arguments": {"a": 1}}]',
        'functools[{"name": "add", "parameters": {"a": 2}}, {"name": "weather", "arguments": '
        '{"city": "Oslo", "tags": ["a", "b"]}}]',
        "Plain text.",
    ],
    "pythonic": [
        "[add(a=1, b='x'), weather(city=\"Paris\", days=-3, metric=true, tags=('a', 'b'))]",
        "[add()]",
        "[weather(opts={'x': None, 'y': [1, 2.5]}, note=null, when=f'now')]",
        "Plain answer [add(a=1)]",
        "[add(a=1)] and text",
        "[a.b(x=1)]",
        "[add(1)]",
        "[]",
    ],
    "qwen3_coder": [
        _xml("weather", **_WEATHER_TEXT),
        _two_adds(_xml),
        _xml("weather", days="2.0", temp="3", metric="0", when="soon", tags="not json"),
        _xml("unknown", q="5"),
        "No tools needed.",
    ],
}


if __name__ == "__main__":  # the texts and tools as JSON, for the peer's venv
    Path(sys.argv[1]).write_text(json.dumps({"tools": TOOLS, "texts": TEXTS}))
