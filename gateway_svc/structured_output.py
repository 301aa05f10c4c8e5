"""A request's output constraint, from whichever field asks for one (OpenAI's
`response_format`, vLLM's `structured_outputs` and its older `guided_*` names, or a forced tool
call) as the `Grammar` the executor compiles. The executor's grammar engine (xgrammar) judges
the spec itself: one it cannot compile ends the request with a 400 giving its reason."""

from __future__ import annotations

import json
from typing import Any

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.request_types import ChatCompletionRequest, CompletionRequest
from turnstile.shared.protocol import Grammar

Request = CompletionRequest | ChatCompletionRequest


def grammar_of(request: Request, forced_call: Grammar | None = None) -> tuple[str, Grammar] | None:
    """The one constraint the request asks for (`forced_call`: the tools' own), if any, with
    the field that asks for it."""
    asked = [(name, grammar) for name, grammar in _asked(request) if grammar is not None]
    if forced_call is not None:
        asked.append(("tool_choice", forced_call))
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise ApiError(400, f"one output constraint at a time; this request has {names}",
                       param=asked[1][0])  # fmt: skip
    return asked[0] if asked else None  # type: ignore[return-value]


def _asked(request: Request) -> list[tuple[str, Grammar | None]]:
    fmt, outputs = request.response_format, request.structured_outputs
    asked: list[tuple[str, Grammar | None]] = [
        ("guided_json", _json(request.guided_json, True, "guided_json")),
        ("guided_regex", _regex(request.guided_regex)),
        ("guided_choice", _choice(request.guided_choice)),
        ("guided_grammar", _ebnf(request.guided_grammar)),
    ]
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", Grammar("json")))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(400, "response_format of type json_schema needs its json_schema",
                           param="response_format.json_schema")  # fmt: skip
        asked.append(("response_format", _json(fmt.json_schema.schema or {}, True, "")))
    if outputs is not None:
        space = not outputs.disable_any_whitespace
        kinds = [
            _json(outputs.json, space, "structured_outputs.json"),
            _regex(outputs.regex),
            _choice(outputs.choice),
            _ebnf(outputs.grammar),
            Grammar("json", any_whitespace=space) if outputs.json_object else None,
        ]
        given = [kind for kind in kinds if kind is not None]
        if len(given) != 1:
            raise ApiError(400, "structured_outputs takes exactly one of json, regex, choice, "
                           "grammar, json_object", param="structured_outputs")  # fmt: skip
        asked.append(("structured_outputs", given[0]))
    return asked


def _json(schema: dict[str, Any] | str | None, any_whitespace: bool, param: str) -> Grammar | None:
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ApiError(400, f"the JSON schema is not JSON: {exc}", param=param) from None
    if not isinstance(schema, dict):
        raise ApiError(400, "a JSON schema must be an object", param=param or "response_format")
    return Grammar("json", json.dumps(schema), any_whitespace)


def _regex(pattern: str | None) -> Grammar | None:
    return None if pattern is None else Grammar("regex", pattern)


def _ebnf(grammar: str | None) -> Grammar | None:
    return None if grammar is None else Grammar("ebnf", grammar)


def _choice(choices: list[str] | None) -> Grammar | None:
    """One of the strings exactly: an EBNF alternation of their literals (JSON's escapes are
    the grammar's)."""
    if choices is None:
        return None
    return Grammar("ebnf", "root ::= " + " | ".join(json.dumps(c) for c in choices))
