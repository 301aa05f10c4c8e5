"""A GGUF file's model shape and family features, as `ModelInfo` fields, read from its metadata
as llama.cpp reads it: where llama.cpp fixes a value by architecture rather than storing it
(Gemma's sliding-layer pattern and attention scale, Gemma 3's local RoPE base), the same value
unless the file's own key says otherwise. Norm weights of Gemma files already hold their 1 +
weight (llama.cpp's converter adds it), so no offset is added here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from turnstile.shared.gguf_header import TensorInfo, read_header
from turnstile.shared.model_support import (
    FREQUENCY_FACTORS,
    NO_ROPE_STEP,
    ORIGINAL,
    check_gguf_fields,
)
from turnstile.shared.pooling import gguf_pooling

Field = Callable[..., Any]  # field(key, default=None): a metadata value
Tensors = dict[str, TensorInfo]
GEMMA = ("gemma2", "gemma3")
# llama.cpp's sliding-layer pattern n (a layer slides unless it is the last of each n) and the
# layer count of Gemma's 27B models, whose attention scale comes from hidden / heads.
_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_LOCAL_ROPE_BASE = 10000.0  # Gemma 3's sliding layers, fixed in llama.cpp
_FLOATS = {0: "f4", 1: "f2"}  # GGML's F32 and F16: the types a factors' vector is stored in
# gpt-oss's: what llama.cpp fixes for the architecture, as transformers' config has it
_GPT_OSS = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_sinks": True,
            "chat_format": "harmony"}  # fmt: skip
# The tokens that end a gpt-oss answer, as its generation_config.json lists them.
_GPT_OSS_ENDS = ("<|return|>", "<|endoftext|>", "<|call|>")


def gguf_fields(path: Path) -> dict[str, Any]:
    """`ModelInfo`'s fields for the GGUF file at `path`."""
    header, name = read_header(path), path.name

    def field(key: str, default: object = None) -> Any:
        return header.fields.get(key, default)

    arch = str(field("general.architecture"))
    check_gguf_fields(arch, field, name)
    tensors = {tensor.name: tensor for tensor in header.tensors}
    hidden = int(field(f"{arch}.embedding_length"))
    heads = int(field(f"{arch}.attention.head_count"))
    layers = int(field(f"{arch}.block_count"))
    head_dim = int(field(f"{arch}.attention.key_length", hidden // heads))
    vocab = field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens"))
    gemma = arch in GEMMA
    return {
        "name": str(field("general.name", path.stem)),
        "num_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": int(field(f"{arch}.feed_forward_length")),
        "num_heads": heads,
        "num_kv_heads": int(field(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "max_model_len": int(field(f"{arch}.context_length")),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id", 2)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "chat_template": field("tokenizer.chat_template"),
        "rope_scaling": _rope_scaling(arch, field, tensors, path, header.little_endian),
        "qk_norm": ("all" if arch == "olmo2" else "head")
        if "blk.0.attn_q_norm.weight" in tensors
        else "",
        "rotary_dim": _rotary_dim(field(f"{arch}.rope.dimension_count"), head_dim),
        "layer_windows": _layer_windows(arch, field, layers),
        "nope_layers": tuple(i for i in range(layers) if (i + 1) % NO_ROPE_STEP == 0)
        if arch == "smollm3"
        else (),
        "hidden_act": "gelu_pytorch_tanh" if gemma else "silu",
        "attention_scale": _attention_scale(arch, field, layers, hidden, heads, head_dim),
        "norms": "sandwich" if gemma else "post" if arch == "olmo2" else "pre",
        "embed_scale": hidden**0.5 if gemma else float(field(f"{arch}.embedding_scale", 1.0)),
        "local_rope_theta": float(field(f"{arch}.rope.freq_base_swa", _LOCAL_ROPE_BASE))
        if arch == "gemma3"
        else 0.0,
        "final_logit_softcapping": float(field(f"{arch}.final_logit_softcapping", 0.0)),
        "attn_logit_softcapping": float(field(f"{arch}.attn_logit_softcapping", 0.0)),
        "residual_multiplier": float(field(f"{arch}.residual_scale", 1.0)),
        "logits_scaling": float(field(f"{arch}.logit_scale", 1.0)),
        **_experts(arch, field, layers, tensors),
        **gguf_pooling(arch, field),
        **(_gpt_oss(field) if arch == "gpt-oss" else {}),
    }


def _gpt_oss(field: Field) -> dict[str, Any]:
    """gpt-oss's features no key stores, and the ids of the tokens that end its answers."""
    tokens = field("tokenizer.ggml.tokens") or []
    ends = [int(field("tokenizer.ggml.eos_token_id", 2))]
    ends += [tokens.index(end) for end in _GPT_OSS_ENDS if end in tokens]
    return {**_GPT_OSS, "eos_token_ids": tuple(dict.fromkeys(ends))}


def _rotary_dim(rotated: int | None, head_dim: int) -> int:
    """The dims of a head RoPE rotates where it rotates part of it (Phi-4-mini's); 0: all."""
    return 0 if rotated is None or rotated == head_dim else int(rotated)


def _rope_scaling(
    arch: str, field: Field, tensors: Tensors, path: Path, little_endian: bool
) -> dict[str, Any] | None:
    """Linear and yarn scaling from their keys; llama.cpp stores Llama 3.1's scaling as each
    frequency's divisor (`rope_freqs`) and Phi-3's longrope as its two factor lists, with the
    attention factor and original context as keys: read back as transformers' longrope
    parameters."""

    def factors(tensor: str) -> list[float]:
        info = tensors[tensor]
        if info.kind not in _FLOATS:
            raise ValueError(f"{path.name}: {tensor} is of GGML type {info.kind}, not F32 or F16")
        dtype = np.dtype(_FLOATS[info.kind]).newbyteorder("<" if little_endian else ">")
        return np.fromfile(path, dtype, count=info.dims[0], offset=info.offset).tolist()

    if "rope_freqs.weight" in tensors:
        return {"rope_type": FREQUENCY_FACTORS, "factors": factors("rope_freqs.weight")}
    if "rope_factors_long.weight" in tensors:
        return {
            "rope_type": "longrope",
            "long_factor": factors("rope_factors_long.weight"),
            "short_factor": factors("rope_factors_short.weight"),
            ORIGINAL: int(field(f"{arch}.rope.scaling.original_context_length")),
            "attention_factor": float(field(f"{arch}.rope.scaling.attn_factor", 1.0)),
        }
    kind, factor = field(f"{arch}.rope.scaling.type"), field(f"{arch}.rope.scaling.factor")
    if kind not in ("linear", "yarn") or not factor:
        return None
    scaling = {"rope_type": kind, "factor": float(factor)}
    if kind == "yarn":  # transformers' defaults for the betas are llama.cpp's
        scaling[ORIGINAL] = int(field(f"{arch}.rope.scaling.original_context_length"))
        if arch == "gpt-oss":  # its config's: the ramp's ends not rounded (llama.cpp rounds them)
            scaling["truncate"] = False
        for beta in ("beta_fast", "beta_slow"):
            value = field(f"{arch}.rope.scaling.yarn_{beta}")
            if value is not None:
                scaling[beta] = float(value)
    return scaling


def _layer_windows(arch: str, field: Field, layers: int) -> tuple[int, ...]:
    """The window on the layers the file's pattern says slide (a bool per layer, or every
    n-th layer full); without a pattern, Gemma's as llama.cpp fixes it, other families' every
    layer."""
    window = int(field(f"{arch}.attention.sliding_window", 0))
    if not window or window >= int(field(f"{arch}.context_length")):
        return ()
    pattern = field(f"{arch}.attention.sliding_window_pattern", _SLIDING_PATTERN.get(arch, 1))
    if isinstance(pattern, list):
        slides = [bool(p) for p in pattern]
    else:
        slides = [pattern == 1 or i % pattern < pattern - 1 for i in range(layers)]
    windows = tuple(window if slide else 0 for slide in slides)
    return windows if any(windows) else ()


def _attention_scale(
    arch: str, field: Field, layers: int, hidden: int, heads: int, head_dim: int
) -> float:
    """The file's `attention.scale`; else Gemma's as llama.cpp computes it (its 27B models
    scale by hidden / heads, the others by the head dim); 0 (head_dim ** -0.5) otherwise."""
    scale = field(f"{arch}.attention.scale")
    if scale:
        return float(scale)
    if arch not in GEMMA:
        return 0.0
    return (hidden / heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim) ** -0.5


def _experts(arch: str, field: Field, layers: int, tensors: Tensors) -> dict[str, Any]:
    count = int(field(f"{arch}.expert_count", 0))
    if not count:
        return {}
    return {
        "num_experts": count,
        "experts_per_token": int(field(f"{arch}.expert_used_count")),
        "expert_intermediate_size": int(
            field(f"{arch}.expert_feed_forward_length", field(f"{arch}.feed_forward_length"))
        ),
        # llama.cpp normalizes Mixtral's and Qwen3-MoE's top-k weights unless the file says not
        "normalize_expert_weights": bool(field(f"{arch}.expert_weights_norm", True)),
        "expert_layers": tuple(
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors
        ),
    }
