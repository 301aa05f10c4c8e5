"""A safetensors checkpoint's weights under the names the model reads, whatever the family
stores: Llama's names, each expert's matrices apart, q, k and v apart, gate and up apart."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from turnstile.kernels.mxfp4_weights import mxfp4_blocks, mxfp4_values
from turnstile.kernels.quantized_weights import QuantizedWeight
from turnstile.shared.model_info import ModelInfo

Weights = dict[str, "torch.Tensor | QuantizedWeight"]
Rows = Callable[[Any, int, int], Any]

# Mixtral's MoE names, as Qwen3-MoE (and the model) names them.
_MIXTRAL_NAMES = {
    "block_sparse_moe.": "mlp.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
}


def common_names(weights: Weights, info: ModelInfo, keep: bool = False) -> Weights:
    """Every family's weights under the names the model reads: Mixtral's experts renamed,
    gpt-oss's unstacked (with `keep`, MXFP4 ones in their blocks), Phi-3's fused matrices
    split."""
    weights = _gpt_oss_experts(weights, keep)
    for name in [n for n in weights if ".mlp.shared_expert." in n]:  # Qwen2-MoE's, as GLM-4.5's
        weights[name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")] = weights.pop(name)
    for name in [n for n in weights if ".block_sparse_moe." in n]:
        new = name
        for old, common in _MIXTRAL_NAMES.items():
            new = new.replace(old, common)
        weights[new] = weights.pop(name)
    return split_fused(weights, info)


def split_fused(weights: Weights, info: ModelInfo, rows: Rows | None = None) -> Weights:
    """Phi-3 stores q, k and v as one `qkv_proj` and gate and up as one `gate_up_proj`: named
    apart (row slices: views, or a quantized weight's rows), as the other families store them;
    `rows(value, start, stop)` cuts a value other than a tensor (a GGUF file's loaders)."""
    cut = rows or (lambda value, start, stop: value[start:stop])
    q_rows, kv_rows = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    for name in [n for n in weights if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
        fused = weights.pop(name)
        if name.endswith("qkv_proj.weight"):
            ends = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows),
                    "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}  # fmt: skip
        else:
            inner = info.intermediate_size
            ends = {"gate": (0, inner), "up": (inner, 2 * inner)}
        fused_name = "qkv_proj" if name.endswith("qkv_proj.weight") else "gate_up_proj"
        for part, (start, stop) in ends.items():
            weights[name.replace(fused_name, f"{part}_proj")] = cut(fused, start, stop)
    return weights


def _gpt_oss_experts(weights: Weights, keep: bool) -> Weights:
    """gpt-oss stacks a layer's experts: `gate_up_proj` [experts, hidden, 2 * inner] (gate and
    up interleaved by column) and `down_proj` [experts, inner, hidden], inputs first, with
    their biases; or, as OpenAI ships them, MXFP4 (`_blocks` and `_scales`, outputs first),
    with `keep` each expert's kept in its blocks where float16 holds their scales. Each
    expert's matrices named apart as Mixtral's (views), its router as `gate`."""
    for name in [n for n in weights if ".mlp.router." in n]:
        weights[name.replace(".mlp.router.", ".mlp.gate.")] = weights.pop(name)
    stacked: dict[str, Any] = {}
    for name in [n for n in weights if n.endswith(("_proj_blocks", "_proj_scales"))]:
        if ".mlp.experts." not in name:
            raise ValueError(f"{name}: MXFP4 is read for gpt-oss's experts only")
        if name.endswith("_blocks"):
            stem = name.removesuffix("_blocks")
            blocks, scales = weights.pop(name), weights.pop(stem + "_scales")
            kept = [mxfp4_blocks(b, s) for b, s in zip(blocks, scales, strict=True)] if keep else []
            if kept and None not in kept:
                stacked[stem] = kept  # each expert's, outputs first
            else:
                weights[stem] = mxfp4_values(blocks, scales).transpose(1, 2)  # inputs first
    stems = [n.removesuffix(".gate_up_proj") for n in weights if n.endswith("experts.gate_up_proj")]
    stems += [n.removesuffix(".gate_up_proj") for n in stacked if n.endswith(".gate_up_proj")]
    for stem in stems:
        gate_up, down = (stacked.pop(f"{stem}.{p}", None) or weights.pop(f"{stem}.{p}")
                         for p in ("gate_up_proj", "down_proj"))  # fmt: skip
        gate_up_bias = weights.pop(stem + ".gate_up_proj_bias")
        down_bias = weights.pop(stem + ".down_proj_bias")
        for e in range(len(gate_up)):
            expert = f"{stem}.{e}."
            weights[expert + "gate_proj.weight"] = _outputs_first(gate_up, e, slice(0, None, 2))
            weights[expert + "up_proj.weight"] = _outputs_first(gate_up, e, slice(1, None, 2))
            weights[expert + "gate_proj.bias"] = gate_up_bias[e, 0::2]
            weights[expert + "up_proj.bias"] = gate_up_bias[e, 1::2]
            weights[expert + "down_proj.weight"] = _outputs_first(down, e, slice(None))
            weights[expert + "down_proj.bias"] = down_bias[e]
    return weights


def _outputs_first(stacked: Any, e: int, rows: slice) -> torch.Tensor | QuantizedWeight:
    """Expert `e`'s output features `rows`: of its kept blocks (outputs first), or of a stacked
    tensor's (inputs first), transposed."""
    if isinstance(stacked, list):
        return stacked[e][rows]
    return stacked[e][:, rows].T
