"""`glm45` and `glm47` (GLM-4.5, 4.6 and 4.7: `glm4_moe`): a call between `<tool_call>` and
`</tool_call>` is the function's name, then each argument as `<arg_key>KEY</arg_key>`
`<arg_value>VALUE</arg_value>`. GLM-4.5 writes a line break after the name, and a call without
one is none to vLLM's `glm45`; GLM-4.7 may write the first key right after the name. A value is
its text where the parameter's schema says `"type": "string"`, else JSON, else a Python literal,
else its text stripped: as vLLM reads them."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from turnstile.gateway_svc.tool_parsers.base import Call, TaggedCalls, make_call
from turnstile.gateway_svc.tool_parsers.schema_values import finite

_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45(TaggedCalls):
    KEEPS_SPECIAL_TOKENS = True
    HEAD = re.compile(r"([^\n]*)\n(.*)", re.DOTALL)  # the name, then its arguments

    def call(self, body: str) -> Call:
        found = self.HEAD.fullmatch(body)
        if found is None:
            raise ValueError("no line break after the function's name")
        name, arguments = found.group(1).strip(), found.group(2) or ""
        kinds = self._kinds(name)
        values = {}
        for key, value in _PAIR.findall(arguments):
            key = key.strip()
            values[key] = value if kinds.get(key) == "string" else _value(value.strip())
        return make_call(name, values)

    def _kinds(self, name: str) -> dict[str, Any]:
        """Each parameter's schema `type`, of the request's function `name`."""
        for tool in self.tools:
            function = tool.get("function") or {}
            if function.get("name") == name:
                properties = (function.get("parameters") or {}).get("properties") or {}
                return {k: v.get("type") for k, v in properties.items() if isinstance(v, dict)}
        return {}


class Glm47(Glm45):
    HEAD = re.compile(r"(.*?)(<arg_key>.*)?", re.DOTALL)


def _value(text: str) -> Any:
    try:
        return finite(json.loads(text))
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
