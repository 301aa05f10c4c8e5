"""Model weights as a Hugging Face-named state dict, from a safetensors directory or a GGUF file.

A GGUF file is dequantized once and cached as safetensors next to the user's cache, so every
later start maps the file instead of dequantizing for seconds; or, with `quantized`, its
Q4_0/Q4_1/Q8_0/Q4_K/Q6_K matrices are kept in their blocks (`kernels/gguf_blocks.py`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save

from turnstile.kernels.gguf_blocks import from_gguf
from turnstile.kernels.quantized_weights import BITS, QuantizedWeight
from turnstile.shared.model_info import ModelInfo, derived_path, write_atomically

Weights = dict[str, "torch.Tensor | QuantizedWeight"]

log = logging.getLogger(__name__)

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def load_weights(path: Path, info: ModelInfo, quantized: bool = False) -> Weights:
    """With `quantized`, a GGUF file's matrices of the kept block types stay in their blocks
    (every other tensor is dequantized); without, every tensor is float32."""
    if quantized:
        return read_gguf(path, info, quantized=True)
    if path.suffix != ".gguf":
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        weights: dict[str, torch.Tensor] = {}
        for file in files:
            weights.update(load_file(file))
        return _common_names(weights, info)
    cached = derived_path(path, "weights.safetensors")
    if cached.exists():
        return load_file(cached)
    weights = read_gguf(path, info)
    if write_atomically(cached, save(weights)):
        log.info("cached dequantized weights in %s", cached)
    return weights


# Mixtral's MoE names, as Qwen3-MoE (and the model) names them.
_MIXTRAL_NAMES = {
    "block_sparse_moe.": "mlp.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
}


def _common_names(weights: dict[str, torch.Tensor], info: ModelInfo) -> dict[str, torch.Tensor]:
    """Every family's weights under the names the model reads. Phi-3 stores q, k and v as one
    `qkv_proj` and gate and up as one `gate_up_proj`: named apart (views), as the other
    families store them; Mixtral's experts are renamed."""
    for name in [n for n in weights if ".block_sparse_moe." in n]:
        new = name
        for old, common in _MIXTRAL_NAMES.items():
            new = new.replace(old, common)
        weights[new] = weights.pop(name)
    q_rows, kv_rows = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    for name in [n for n in weights if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
        fused = weights.pop(name)
        if name.endswith("qkv_proj.weight"):
            parts = dict(zip("qkv", fused.split((q_rows, kv_rows, kv_rows)), strict=True))
            weights.update({name.replace("qkv_proj", f"{p}_proj"): w for p, w in parts.items()})
        else:
            gate, up = fused.chunk(2)
            weights[name.replace("gate_up_proj", "gate_proj")] = gate
            weights[name.replace("gate_up_proj", "up_proj")] = up
    return weights


def read_gguf(path: Path, info: ModelInfo, quantized: bool = False) -> Weights:
    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    weights: Weights = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        value: torch.Tensor | QuantizedWeight
        if quantized and tensor.tensor_type in BITS:
            value = from_gguf(tensor.data, tensor.tensor_type)
        else:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            value = torch.from_numpy(np.ascontiguousarray(values.astype(np.float32)))
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = value[_rope_order(value.shape[0], info.num_heads)]
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = value[_rope_order(value.shape[0], info.num_kv_heads)]
        weights[name] = value
    return weights


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}"


def _rope_order(rows: int, num_heads: int) -> torch.Tensor:
    """The rows in Hugging Face's order: llama.cpp interleaves each head's rotary halves."""
    order = torch.arange(rows).view(num_heads, rows // num_heads // 2, 2)
    return order.transpose(1, 2).reshape(-1)
