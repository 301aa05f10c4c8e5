"""What every tool-call parser shares: a call as OpenAI's `tool_calls` entry; the text held back
while it may still become (part of) a call; and calls each written between a start and an end
tag, which Hermes's, Qwen3-Coder's and GLM's formats share."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from typing import Any

from turnstile.gateway_svc.text_stream import partial_suffix
from turnstile.gateway_svc.tool_parsers.schema_values import coerce

Call = dict[str, Any]
Read = tuple[str, list[Call]]  # the text that can no longer become a call, the calls complete


def make_call(name: Any, arguments: Any) -> Call:
    if not isinstance(name, str) or not name:
        raise ValueError("a call without a name")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}  # fmt: skip


class ToolParser(ABC):
    """One choice's text, fed piece by piece (`feed`), then `finish`."""

    # vLLM's parser of this name decodes a tool request keeping special tokens (its
    # `adjust_request`): the marker may be one (Mistral's [TOOL_CALLS], Granite's <|tool_call|>).
    KEEPS_SPECIAL_TOKENS = False

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.tools = tools  # the request's, as OpenAI's API writes them
        self.text = ""  # held back: it may still become (part of) a call

    def feed(self, piece: str) -> Read:
        self.text += piece
        return self.read(final=False)

    def finish(self) -> Read:
        return self.read(final=True)

    @abstractmethod
    def read(self, final: bool) -> Read:
        """What `text` settles; `final`: no more text comes."""

    def arguments(self, name: str, pairs: list[tuple[str, str]]) -> dict[str, Any]:
        """Function `name`'s arguments from (key, text) pairs, each text read as its parameter's
        JSON-schema type says (`schema_values.coerce`); as written where the request's tools do
        not describe it."""
        properties: dict[str, Any] = {}
        for tool in self.tools:
            function = tool.get("function") or {}
            if function.get("name") == name:
                properties = (function.get("parameters") or {}).get("properties") or {}
        found = {}
        for key, text in pairs:
            schema = properties.get(key.strip())
            found[key.strip()] = coerce(text, schema) if isinstance(schema, dict) else text
        return found

    def take(self) -> str:
        text, self.text = self.text, ""
        return text


class TaggedCalls(ToolParser):
    """Calls each between `<tool_call>` and `</tool_call>`, read as each block ends (a block
    cut short by the end of the answer, as it stands). A block that is no call stays text;
    whitespace beside calls is dropped (vLLM's content is then None)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self.found = 0

    @abstractmethod
    def call(self, body: str) -> Call | None:
        """The call a block's body writes; ValueError, TypeError or KeyError where none; None
        for a block dropped whole (GLM's call of a function the request does not offer)."""

    def read(self, final: bool) -> Read:
        said: list[str] = []
        calls: list[Call] = []

        def say(text: str) -> None:  # whitespace after a call is the calls' framing
            if text.strip() or not (self.found or calls):
                said.append(text)

        while True:
            start = self.text.find(self.START)
            if start < 0:  # hold back what may be the start of a tag still coming
                keep = 0 if final else partial_suffix(self.text, self.START)
                say(self.text[: len(self.text) - keep])
                self.text = self.text[len(self.text) - keep :]
                break
            say(self.text[:start])
            end = self.text.find(self.END, start)
            if end < 0 and not final:
                self.text = self.text[start:]
                break
            body = self.text[start + len(self.START) : end if end >= 0 else None]
            try:
                calls.extend(c for c in [self.call(body)] if c is not None)
            except (ValueError, TypeError, KeyError):  # the block as written
                said.append(self.text[start : end + len(self.END) if end >= 0 else None])
            self.text = self.text[end + len(self.END) :] if end >= 0 else ""
        self.found += len(calls)
        text = "".join(said)
        return ("" if self.found and not text.strip() else text), calls
