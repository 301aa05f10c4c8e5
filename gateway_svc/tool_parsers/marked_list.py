"""Text, then a marker and the calls as one JSON list of `{"name": ..., "arguments": {...}}`
(or `"parameters"`), read whole at the end; a list that does not parse leaves the answer
text. `granite` (IBM Granite 3.x: `<|tool_call|>` or `<tool_call>`) and `phi4_mini_json`
(Phi-4-mini: `functools[...]`)."""

from __future__ import annotations

import json

from turnstile.gateway_svc.text_stream import partial_suffix
from turnstile.gateway_svc.tool_parsers.base import Read, ToolParser, make_call


class MarkedList(ToolParser):
    MARKS: tuple[str, ...]  # any of them starts the calls; the list follows

    def read(self, final: bool) -> Read:
        found = [(at, mark) for mark in self.MARKS if (at := self.text.find(mark)) >= 0]
        if not found:  # hold back what may be the start of a marker still coming
            keep = 0 if final else max(partial_suffix(self.text, mark) for mark in self.MARKS)
            said, self.text = self.text[: len(self.text) - keep], self.text[len(self.text) - keep :]
            return said, []
        start, mark = min(found)
        said, self.text = self.text[:start], self.text[start:]
        if not final:
            return said, []  # the calls: read whole at the end
        body = self.text[len(mark) :].strip()
        try:
            listed, end = json.JSONDecoder().raw_decode(body)
            if body[end:].strip() or not isinstance(listed, list):
                raise ValueError("text after the calls")
            calls = [make_call(c["name"], c.get("arguments", c.get("parameters", {})))
                     for c in listed]  # fmt: skip
        except (ValueError, TypeError, KeyError, AttributeError):
            return said + self.take(), []
        self.text = ""
        return ("" if calls and not said.strip() else said), calls


class Granite(MarkedList):
    KEEPS_SPECIAL_TOKENS = True
    MARKS = ("<|tool_call|>", "<tool_call>")


class Phi4MiniJson(MarkedList):
    MARKS = ("functools",)  # the list's own `[` follows
