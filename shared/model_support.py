"""What Turnstile runs exactly, and the refusal, at start and by name, of what it does not: a
model whose config asks for a feature the executor lacks would otherwise run and answer wrongly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# config.json's model_type: the Llama-family decoders the executor computes.
FAMILIES = ("llama", "mistral", "qwen2")
# RoPE types as transformers names them; the scaled ones are computed by transformers itself.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModel(ValueError):
    """A model, or a setting of it, that Turnstile does not run."""


def rope_type(scaling: dict[str, Any] | None) -> str:
    scaling = scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def check_hf_config(config: dict[str, Any], source: str) -> None:
    """Refuse a config.json asking for what the executor does not compute, naming the field."""
    family = config.get("model_type")
    if family not in FAMILIES:
        _refuse(source, "model_type", family, f"supported: {', '.join(FAMILIES)}")
    if config.get("hidden_act", "silu") != "silu":
        _refuse(source, "hidden_act", config["hidden_act"], "supported: silu")
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if rope_type(rope) not in ROPE_TYPES:
        _refuse(source, "rope_scaling.rope_type", rope_type(rope),
                f"supported: {', '.join(ROPE_TYPES)}")  # fmt: skip
    partial = (rope or {}).get("partial_rotary_factor", config.get("partial_rotary_factor", 1))
    if float(partial) != 1:
        _refuse(source, "partial_rotary_factor", partial, "RoPE on part of a head: not implemented")
    window = config.get("sliding_window")
    binds = window is not None and window < config.get("max_position_embeddings", 4096)
    if binds and config.get("use_sliding_window", family != "qwen2"):
        _refuse(source, "sliding_window", window, "sliding-window attention is not implemented")
    if family != "qwen2" and config.get("attention_bias"):
        _refuse(source, "attention_bias", True, "biases on q, k, v and o are not implemented")
    if config.get("mlp_bias"):
        _refuse(source, "mlp_bias", True, "MLP biases are not implemented")


def check_gguf_fields(arch: str, field: Callable[[str], Any], source: str) -> None:
    """Refuse a GGUF file whose metadata (`field(key)`, None where absent) asks for what the
    executor does not compute."""
    if arch not in FAMILIES:
        _refuse(source, "general.architecture", arch, f"supported: {', '.join(FAMILIES)}")
    scaling = field(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        _refuse(source, f"{arch}.rope.scaling.type", scaling, "RoPE scaling from GGUF is not read")
    window = field(f"{arch}.attention.sliding_window")
    if window:
        _refuse(source, f"{arch}.attention.sliding_window", window, "not implemented")


def _refuse(source: str, field: str, value: object, why: str) -> None:
    raise UnsupportedModel(f"{source}: {field} = {value!r} is not supported ({why})")
