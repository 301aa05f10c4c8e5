"""A text value read as its JSON-schema type says, as vLLM's tool parsers coerce one: the types
its schema allows (`type`, an `enum`'s values, `anyOf` / `oneOf` / `allOf`; none: a string), tried
in the order null, integer, number, boolean, object, array, string; the text where none fits."""

from __future__ import annotations

import json
import math
from typing import Any

ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
ALIASES = {"str": "string", "text": "string", "int": "integer", "float": "number",
           "double": "number", "bool": "boolean", "dict": "object", "list": "array"}  # fmt: skip
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))  # fmt: skip


def types_of(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return {"string"}
    found: set[str] = set()
    kind = schema.get("type")
    for name in [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []:
        if isinstance(name, str):
            found.add(ALIASES.get(name.strip().lower(), name.strip().lower()))
    for value in schema.get("enum") or []:
        found.add(
            "null" if value is None else next(t for c, t in _ENUM_TYPES if isinstance(value, c))
        )
    for choice in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(choice) or []:
            found |= types_of(option)
    return found or {"string"}


def coerce(value: str, schema: dict[str, Any]) -> Any:
    allowed = types_of(schema)
    for kind in (k for k in ORDER if k in allowed):
        if kind == "string":
            return value
        if kind == "null" and value.lower() == "null":
            return None
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        if kind == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if kind in ("object", "array"):
            try:
                return finite(json.loads(value))
            except ValueError:
                continue
    try:
        return finite(json.loads(value))
    except ValueError:
        return value


def finite(value: Any) -> Any:
    """JSON's own numbers only: 1e999 is no value JSON can write again."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("not finite")
    for inner in (
        value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    ):
        finite(inner)
    return value
