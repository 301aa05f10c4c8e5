"""Tool calling, as vLLM serves it: `tools` reach the chat template; `tool_choice` "required" or
a named function is forced by a grammar (the answer is the calls' JSON, so it always parses);
"auto" lets the model choose, and the server's `--tool-call-parser` finds the calls in its text.

Each choice's text goes through a `CallReader`, whole or piece by piece (streaming): it passes
the plain text on and returns each call as OpenAI's `tool_calls` entry once it is complete.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.request_types import ChatCompletionRequest, NamedToolChoice
from turnstile.gateway_svc.text_stream import partial_suffix
from turnstile.shared.protocol import Grammar

_PYTHON_TAG = "<|python_tag|>"  # Llama 3's mark before a call
Call = dict[str, Any]


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


def _call(name: Any, arguments: Any) -> Call:
    if not isinstance(name, str):
        raise ValueError("a call without a name")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}  # fmt: skip


class CallReader:
    """One choice's text, split into what is said and the calls; `feed` per piece, then
    `finish`. Each returns (text to show now, calls now complete)."""

    def __init__(self, mode: str, parser: str | None, function: str = "") -> None:
        self.mode, self.parser, self.function = mode, parser, function
        self.calls = 0
        self._text = ""  # held back: it may still become (part of) a call
        self._plain = False  # llama3_json: the text is no call

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
        self._text += piece
        if self.mode != "auto":
            return "", []  # a forced call's JSON, read whole at the end
        if self.parser == "hermes":
            return self._hermes(final=False)
        head = self._text.lstrip()
        if not self._plain and (
            head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head)
        ):
            return "", []  # llama3_json: may be a call, read whole at the end
        self._plain = True
        return self._take(), []

    def finish(self) -> tuple[str, list[Call]]:
        if self.mode == "named":
            self.calls = 1
            return "", [_call(self.function, self._text)]
        if self.mode == "required":
            try:
                calls = [_call(c["name"], c["parameters"]) for c in json.loads(self._text)]
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens
                return self._take(), []
            self.calls = len(calls)
            return "", calls
        if self.parser == "hermes":
            return self._hermes(final=True)
        return self._llama3_json()

    def _take(self) -> str:
        text, self._text = self._text, ""
        return text

    def _hermes(self, final: bool) -> tuple[str, list[Call]]:
        """Calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
        said, calls = [], []
        while True:
            start = self._text.find("<tool_call>")
            if start < 0:
                # Hold back what may be the start of a tag still coming.
                keep = 0 if final else partial_suffix(self._text, "<tool_call>")
                said.append(self._text[: len(self._text) - keep])
                self._text = self._text[len(self._text) - keep :]
                break
            said.append(self._text[:start])
            end = self._text.find("</tool_call>", start)
            body = self._text[start + len("<tool_call>") : end if end >= 0 else None]
            if end < 0 and not final:
                self._text = self._text[start:]
                break
            try:
                found = json.loads(body)
                calls.append(_call(found["name"], found.get("arguments", {})))
            except (ValueError, TypeError, KeyError):
                said.append(self._text[start : end if end >= 0 else None])
            self._text = self._text[end + len("</tool_call>") :] if end >= 0 else ""
        self.calls += len(calls)
        text = "".join(said)
        return ("" if self.calls and not text.strip() else text), calls

    def _llama3_json(self) -> tuple[str, list[Call]]:
        """Calls as `{"name": ..., "parameters": {...}}`, several joined by `;`, maybe after
        Llama's `<|python_tag|>`."""
        text = self._take()
        body = text.strip().removeprefix(_PYTHON_TAG)
        try:
            decoder, calls, at = json.JSONDecoder(), [], 0
            while at < len(body):
                found, at = decoder.raw_decode(body, at)
                calls.append(_call(found["name"], found.get("parameters", found.get("arguments"))))
                at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        except (ValueError, TypeError, KeyError):
            return text, []
        self.calls += len(calls)
        return "", calls


class CallReaders:
    """The `CallReader` of each choice of one request."""

    def __init__(self, mode: str, parser: str | None, request: ChatCompletionRequest) -> None:
        self._function = named_function(request)
        self._mode, self._parser = mode, parser
        self._readers: dict[int, CallReader] = {}

    def __getitem__(self, index: int) -> CallReader:
        if index not in self._readers:
            self._readers[index] = CallReader(self._mode, self._parser, self._function)
        return self._readers[index]
