"""Tool calling, as vLLM serves it: `tools` reach the chat template; `tool_choice` "required" or
a named function is forced by a grammar (the answer is the calls' JSON, so it always parses);
"auto" lets the model choose, and the server's `--tool-call-parser` finds the calls in its text.

Each choice's text goes through a `CallReader`, whole or piece by piece (streaming): it passes
the plain text on and returns each call as OpenAI's `tool_calls` entry once it is complete.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.request_types import ChatCompletionRequest, NamedToolChoice
from turnstile.gateway_svc.tool_parsers import PARSERS, Call, make_call
from turnstile.shared.protocol import Grammar


def keeps_special_tokens(mode: str | None, parser: str | None) -> bool:
    """Whether a chat's answer is decoded with its special tokens, as vLLM's tool parser of that
    name has it decoded (its `adjust_request`): a call's marker may be one."""
    return mode is not None and parser is not None and PARSERS[parser].KEEPS_SPECIAL_TOKENS


def tool_mode(request: ChatCompletionRequest, parser: str | None) -> str | None:
    """How the request's output holds calls: "required", "named", "auto", or None (none)."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {tool.function.name for tool in request.tools}:
            raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not "
                           "among the tools", param="tool_choice")  # fmt: skip
        return "named"
    if choice in (None, "auto"):  # vLLM's default with tools: auto, which needs a parser
        if parser is None:
            raise ApiError(400, '"auto" tool choice needs a server started with '
                           "--enable-auto-tool-choice and --tool-call-parser; use "
                           '"required" or a named function', param="tool_choice")  # fmt: skip
        return "auto"
    return None if choice == "none" else "required"


def forced_call(request: ChatCompletionRequest, mode: str | None) -> Grammar | None:
    """The grammar of a forced call: the named function's arguments, or a list of calls
    [{"name", "parameters"}] of the tools (one call where parallel_tool_calls is false)."""
    tools = request.tools or []
    if mode == "named":
        name = named_function(request)
        function = next(tool.function for tool in tools if tool.function.name == name)
        return Grammar("json", json.dumps(_parameters(function.parameters)))
    if mode != "required":
        return None
    calls = [
        {"type": "object", "properties": {"name": {"const": tool.function.name},
                                          "parameters": _parameters(tool.function.parameters)},
         "required": ["name", "parameters"]}
        for tool in tools
    ]  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return Grammar("json", json.dumps(schema))


def named_function(request: ChatCompletionRequest) -> str:
    """The function `tool_choice` names, or "" where it names none."""
    choice = request.tool_choice
    return choice.function.name if isinstance(choice, NamedToolChoice) else ""


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    return schema if schema is not None else {"type": "object", "properties": {}}


def template_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as chat templates read them (transformers' `tools=`)."""
    return None if not request.tools else msgspec.to_builtins(request.tools)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's calls with their arguments as objects, as templates expect."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    readable = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                raise ApiError(400, "a tool call's arguments are not JSON",
                               param="messages") from None  # fmt: skip
        readable.append(call | {"function": function})
    return message | {"tool_calls": readable}


class CallReader:
    """One choice's text, split into what is said and the calls; `feed` per piece, then
    `finish`. Each returns (text to show now, calls now complete)."""

    def __init__(
        self,
        mode: str,
        parser: str | None,
        function: str = "",
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.mode, self.function = mode, function
        self.calls = 0
        self._parser = PARSERS[parser](tools or []) if mode == "auto" and parser else None
        self._text = ""  # a forced call's JSON, read whole at the end

    def whole(self, text: str, reason: str) -> tuple[str, list[Call], str]:
        """A whole answer: its text, its calls, and its finish reason."""
        said, calls = self.feed(text)
        rest, more = self.finish()
        return said + rest, calls + more, self._reason(reason)

    def step(self, piece: str, reason: str | None) -> tuple[str, list[Call], str | None]:
        """A streamed piece (the last has its finish reason): the text to send, and the calls
        now complete as stream deltas (with their index)."""
        first = self.calls
        said, calls = self.feed(piece)
        if reason is not None:
            rest, more = self.finish()
            said, calls = said + rest, calls + more
        deltas = [{"index": first + k} | call for k, call in enumerate(calls)]
        return said, deltas, None if reason is None else self._reason(reason)

    def _reason(self, reason: str) -> str:
        """OpenAI's: "tool_calls" when the model chose to call; a forced named call "stop"."""
        if reason != "stop" or not self.calls:
            return reason
        return "tool_calls" if self.mode != "named" else "stop"

    def feed(self, piece: str) -> tuple[str, list[Call]]:
        if self._parser is None:
            self._text += piece
            return "", []
        return self._counted(self._parser.feed(piece))

    def finish(self) -> tuple[str, list[Call]]:
        if self._parser is not None:
            return self._counted(self._parser.finish())
        if self.mode == "named":
            self.calls = 1
            return "", [make_call(self.function, self._text)]
        try:
            calls = [make_call(c["name"], c["parameters"]) for c in json.loads(self._text)]
        except (ValueError, TypeError, KeyError):  # cut short by max_tokens
            text, self._text = self._text, ""
            return text, []
        self.calls = len(calls)
        return "", calls

    def _counted(self, read: tuple[str, list[Call]]) -> tuple[str, list[Call]]:
        self.calls += len(read[1])
        return read


class CallReaders:
    """The `CallReader` of each choice of one request."""

    def __init__(self, mode: str, parser: str | None, request: ChatCompletionRequest) -> None:
        self._function = named_function(request)
        self._mode, self._parser = mode, parser
        self._tools = template_tools(request) or []
        self._readers: dict[int, CallReader] = {}

    def __getitem__(self, index: int) -> CallReader:
        if index not in self._readers:
            self._readers[index] = CallReader(self._mode, self._parser, self._function, self._tools)
        return self._readers[index]
