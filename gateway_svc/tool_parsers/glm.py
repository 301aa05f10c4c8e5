"""`glm45` and `glm47` (GLM-4.5, 4.6 and 4.7: `glm4_moe`; one parser in vLLM 0.32 under both
names): a call between `<tool_call>` and `</tool_call>` is the function's name, then each
argument as `<arg_key>KEY</arg_key>` `<arg_value>VALUE</arg_value>` (GLM-4.5 breaks the line
after the name; GLM-4.7 may not, and a call may have no argument). A value is text, read as its
parameter's JSON-schema type says (`schema_values.py`), as vLLM coerces it; a call of a function
the request does not offer is dropped."""

from __future__ import annotations

import re

from turnstile.gateway_svc.tool_parsers.base import Call, TaggedCalls, make_call

_HEAD = re.compile(r"(.*?)(<arg_key>.*)?", re.DOTALL)  # the name, then its arguments
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm(TaggedCalls):
    KEEPS_SPECIAL_TOKENS = True

    def call(self, body: str) -> Call | None:
        found = _HEAD.fullmatch(body)
        assert found is not None  # every body matches: the name may be all of it
        name = found.group(1).strip()
        if name not in {(tool.get("function") or {}).get("name") for tool in self.tools}:
            return None  # a function the request does not offer: dropped, as vLLM drops it
        return make_call(name, self.arguments(name, _PAIR.findall(found.group(2) or "")))
