"""`mistral` (Mistral, Mixtral): text, then `[TOOL_CALLS]` and the calls: a JSON list of
`{"name": ..., "arguments": {...}}` (tokenizers before v11), or each call as `name{...}` (v11)
or `name[ARGS]{...}` (v13), each after its own `[TOOL_CALLS]`. Calls that do not parse leave the
whole answer text."""

from __future__ import annotations

import json

from turnstile.gateway_svc.text_stream import partial_suffix
from turnstile.gateway_svc.tool_parsers.base import Call, Read, ToolParser, make_call

MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"


class Mistral(ToolParser):
    KEEPS_SPECIAL_TOKENS = True

    def read(self, final: bool) -> Read:
        start = self.text.find(MARK)
        if start < 0:
            keep = 0 if final else partial_suffix(self.text, MARK)
            said = self.text[: len(self.text) - keep]
            self.text = self.text[len(self.text) - keep :]
            return said, []
        said, self.text = self.text[:start], self.text[start:]
        if not final:
            return said, []  # the calls: read whole at the end
        try:
            calls = [call for part in self.text.split(MARK)[1:] for call in _calls(part.strip())]
        except (ValueError, TypeError, KeyError, AttributeError):
            return said + self.take(), []
        self.text = ""
        return ("" if calls and not said.strip() else said), calls


def _calls(part: str) -> list[Call]:
    if part.startswith("["):
        return [make_call(c["name"], c.get("arguments", {})) for c in json.loads(part)]
    name, _, arguments = part.partition(ARGS) if ARGS in part else _split_at_brace(part)
    found, end = json.JSONDecoder().raw_decode(arguments.lstrip())
    if arguments.lstrip()[end:].strip() or not isinstance(found, dict):
        raise ValueError("text after a call's arguments")
    return [make_call(name.strip(), found)]


def _split_at_brace(part: str) -> tuple[str, str, str]:
    at = part.index("{")
    return part[:at], "", part[at:]
