"""`pythonic` (Llama 3.2, Llama 4, Gemma 3...): the whole answer a Python list of calls with
keyword arguments, `[get_weather(city='Paris'), ...]`; else it is text. Arguments are Python
literals (and JSON's `null`, `true`, `false`)."""

from __future__ import annotations

import ast
from typing import Any

from turnstile.gateway_svc.tool_parsers.base import Call, Read, ToolParser, make_call

_JSON_NAMES = {"null": None, "true": True, "false": False}


class Pythonic(ToolParser):
    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self.plain = False  # the answer began as no list of calls can

    def read(self, final: bool) -> Read:
        self.plain = self.plain or (bool(self.text) and not self.text.startswith("["))
        if self.plain or not final:
            return (self.take(), []) if self.plain else ("", [])
        text = self.take()
        try:
            found = ast.parse(text).body
            if len(found) != 1 or not isinstance(found[0], ast.Expr):
                raise ValueError("not one expression")
            listed = found[0].value
            if not isinstance(listed, ast.List) or not listed.elts:
                raise ValueError("not a list of calls")
            return "", [_call(element) for element in listed.elts]
        except (SyntaxError, ValueError, TypeError):
            return text, []


def _call(node: ast.expr) -> Call:
    """A call of a plain name (vLLM's pattern: a letter first, no dots) by keywords."""
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
        raise ValueError("not a named call with keyword arguments")
    if not node.func.id[0].isalpha() or any(keyword.arg is None for keyword in node.keywords):
        raise ValueError("a name vLLM's pattern refuses, or **arguments")
    return make_call(node.func.id, {kw.arg: _value(kw.value) for kw in node.keywords})


def _value(node: ast.expr) -> Any:
    """A literal as JSON holds it: tuples and sets as lists, f-strings of constants as text."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        if not all(isinstance(key, ast.Constant) for key in node.keys):
            raise ValueError("a dict key that is no literal")
        pairs = zip(node.keys, node.values, strict=True)
        return {key.value: _value(value) for key, value in pairs}  # type: ignore[union-attr]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [_value(element) for element in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(part.value) for part in node.values)  # type: ignore[attr-defined]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _value(node.operand)
        if isinstance(operand, int | float) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | None):
        return node.value
    raise ValueError("an argument that is no JSON value")
