"""The `--tool-call-parser`s, by vLLM's names: each finds a model's calls in its text as vLLM's
parser of that name does, fed piece by piece (streaming) or whole (`base.py`)."""

from __future__ import annotations

from turnstile.gateway_svc.tool_parsers.base import Call, ToolParser, make_call
from turnstile.gateway_svc.tool_parsers.glm import Glm
from turnstile.gateway_svc.tool_parsers.harmony_calls import HarmonyCalls
from turnstile.gateway_svc.tool_parsers.hermes import Hermes
from turnstile.gateway_svc.tool_parsers.llama3_json import Llama3Json
from turnstile.gateway_svc.tool_parsers.marked_list import Granite, Phi4MiniJson
from turnstile.gateway_svc.tool_parsers.mistral import Mistral
from turnstile.gateway_svc.tool_parsers.pythonic import Pythonic
from turnstile.gateway_svc.tool_parsers.qwen3_coder import Qwen3Coder

PARSERS: dict[str, type[ToolParser]] = {
    "glm45": Glm,
    "glm47": Glm,
    "granite": Granite,
    "hermes": Hermes,
    "llama3_json": Llama3Json,
    "mistral": Mistral,
    "openai": HarmonyCalls,
    "phi4_mini_json": Phi4MiniJson,
    "pythonic": Pythonic,
    "qwen3_coder": Qwen3Coder,
}

__all__ = ["PARSERS", "Call", "ToolParser", "make_call"]
