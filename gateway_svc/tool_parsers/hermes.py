"""`hermes` (Hermes 2 Pro, Qwen2.5 and Qwen3): `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`."""

from __future__ import annotations

import json

from turnstile.gateway_svc.tool_parsers.base import Call, TaggedCalls, make_call


class Hermes(TaggedCalls):
    KEEPS_SPECIAL_TOKENS = True

    def call(self, body: str) -> Call:
        found = json.loads(body)
        return make_call(found["name"], found.get("arguments", {}))
