"""`openai` (gpt-oss): the calls the harmony reader (`gateway_svc/harmony.py`) found among the
answer's messages, each a message to `functions.NAME`, passed on as `<|call|>NAME<|message|>
ARGUMENTS<|end|>`. Arguments that parse as JSON are given as compact JSON, others as written
(vLLM's)."""

from __future__ import annotations

import contextlib
import json

from turnstile.gateway_svc.harmony import CALL, END, MESSAGE
from turnstile.gateway_svc.tool_parsers.base import Call, TaggedCalls, make_call


class HarmonyCalls(TaggedCalls):
    START, END = CALL, END
    KEEPS_SPECIAL_TOKENS = True

    def call(self, body: str) -> Call:
        name, _, arguments = body.partition(MESSAGE)
        with contextlib.suppress(json.JSONDecodeError):  # else as written, as vLLM gives them
            arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
        return make_call(name, arguments)
