"""`llama3_json` (Llama 3.1 to 3.3): the whole answer is `{"name": ..., "parameters": {...}}`,
several joined by `;`, maybe after Llama's `<|python_tag|>`; else it is text."""

from __future__ import annotations

import json
from typing import Any

from turnstile.gateway_svc.tool_parsers.base import Read, ToolParser, make_call

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(ToolParser):
    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self.plain = False  # the answer began as no call can

    def read(self, final: bool) -> Read:
        head = self.text.lstrip()
        if not final:
            if not self.plain and (
                head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)
            ):
                return "", []  # may be a call: read whole at the end
            self.plain = True
            return self.take(), []
        text = self.take()
        body = text.strip().removeprefix(PYTHON_TAG)
        try:
            decoder, calls, at = json.JSONDecoder(), [], 0
            while at < len(body):
                found, at = decoder.raw_decode(body, at)
                calls.append(
                    make_call(found["name"], found.get("parameters", found.get("arguments")))
                )
                at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        except (ValueError, TypeError, KeyError):
            return text, []
        return "", calls
