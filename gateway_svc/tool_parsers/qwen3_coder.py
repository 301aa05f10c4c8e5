"""`qwen3_coder` (Qwen3-Coder): calls as XML between `<tool_call>` and `</tool_call>`,
`<function=NAME>`, then each argument as `<parameter=KEY>` value `</parameter>`. A value is text,
read as its parameter's JSON-schema type says, as vLLM coerces it (`schema_values.py`)."""

from __future__ import annotations

import re

from turnstile.gateway_svc.tool_parsers.base import Call, TaggedCalls, make_call

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


class Qwen3Coder(TaggedCalls):
    KEEPS_SPECIAL_TOKENS = True

    def call(self, body: str) -> Call:
        found = _FUNCTION.search(body)
        if found is None:
            raise ValueError("no <function=...>")
        name, inner = found.group(1).strip(), found.group(2)
        pairs = [(key, raw.removeprefix("\n").removesuffix("\n"))
                 for key, raw in _PARAMETER.findall(inner)]  # fmt: skip
        return make_call(name, self.arguments(name, pairs))
