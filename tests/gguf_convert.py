"""A Hugging Face checkpoint folder written as a float32 GGUF file with the `gguf` package, as
llama.cpp's convert_hf_to_gguf.py writes each family: tensor names from gguf's own table, a
Llama-architecture file's q and k rows permuted to llama.cpp's rotary order, Gemma's norm
weights stored as 1 + weight, each layer's experts stacked in one tensor, Phi-3's fused
matrices kept fused, Llama 3's and Phi-3's RoPE factors as tensors. Where llama.cpp fixes
a value by architecture (Gemma's sliding-layer pattern and attention scale) or has no key for it
(a window on Llama or Qwen layers), the file carries gguf's generic key for it, since these
small models set them otherwise."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from turnstile.shared.model_support import (
    PERMUTED_ARCHITECTURES,
    layer_windows,
    rope_parameters,
    rotary_dim,
)

ARCHITECTURES = {
    "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
    "granite": "granite", "olmo2": "olmo2", "smollm3": "smollm3", "gpt_oss": "gpt-oss",
}  # fmt: skip
_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight")


def write_gguf(folder: Path, path: Path, blocks: gguf.GGMLQuantizationType | None = None) -> Path:
    """With `blocks`, the layers' matrices (experts and routers too) are stored in that block
    type (the rest float32)."""
    config = json.loads((folder / "config.json").read_text())
    arch = ARCHITECTURES[config["model_type"]]
    writer = gguf.GGUFWriter(path, arch)
    _write_metadata(writer, config)
    table = gguf.get_tensor_name_map(
        next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch),
        config["num_hidden_layers"],
    )
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    experts: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    checkpoint = {}
    for shard in sorted(folder.glob("*.safetensors")):
        checkpoint.update(load_file(shard))
    if arch == "gpt-oss":
        checkpoint = _gpt_oss_tensors(checkpoint, writer, table)
    for name, tensor in checkpoint.items():
        stacked = _EXPERT.fullmatch(name)
        if stacked:  # gathered, then written as one tensor per layer and projection
            experts[f"{stacked[1]}.{stacked[3]}"][int(stacked[2])] = tensor
            continue
        if arch in PERMUTED_ARCHITECTURES and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = _permute(tensor, heads if "q_proj" in name else kv_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            tensor = tensor + 1
        if arch in ("gemma2", "gemma3") and name == "lm_head.weight":
            continue  # tied: llama.cpp's converter drops it
        if blocks is not None and ".layers." in name and tensor.ndim == 2:
            data = gguf.quants.quantize(np.ascontiguousarray(tensor), blocks)
            writer.add_tensor(_gguf_name(table, name), data, raw_dtype=blocks)
            continue
        writer.add_tensor(_gguf_name(table, name), np.ascontiguousarray(tensor))
    for name, by_expert in experts.items():
        stack = np.stack([by_expert[e] for e in sorted(by_expert)])
        if blocks is None:
            writer.add_tensor(_gguf_name(table, name + ".weight"), stack)
        else:  # each expert's rows in blocks, as llama.cpp quantizes them
            data = gguf.quants.quantize(stack, blocks)
            writer.add_tensor(_gguf_name(table, name + ".weight"), data, raw_dtype=blocks)
    for name, factors in _rope_factors(config).items():
        writer.add_tensor(name, np.array(factors, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gpt_oss_tensors(
    checkpoint: dict[str, np.ndarray], writer: gguf.GGUFWriter, table: gguf.TensorNameMap
) -> dict[str, np.ndarray]:
    """gpt-oss's stacked experts written as llama.cpp's converter writes them, the rest
    returned: outputs first, gate and up (interleaved rows) apart; MXFP4 blocks as GGML's (a
    scale byte, then 16 bytes whose low nibbles hold a block's first 16 codes); the sinks
    named `.weight`."""
    rest = {}
    for name, tensor in checkpoint.items():
        stem = name.removesuffix("_blocks").removesuffix("_scales").removesuffix("_bias")
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            scales = checkpoint[stem + "_scales"]
            codes = np.stack((tensor & 0x0F, tensor >> 4), axis=-1).reshape(*tensor.shape[:-1], 32)
            packed = codes[..., :16] | (codes[..., 16:] << 4)
            blocks = np.concatenate((scales[..., None], packed), axis=-1)
            blocks = blocks.reshape(*blocks.shape[:2], -1)
        elif name.endswith("_bias") and ".experts." in name:
            blocks = tensor
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks = tensor.transpose(0, 2, 1)  # outputs first
        else:
            rest[name + ".weight" if name.endswith(".sinks") else name] = tensor
            continue
        kind = gguf.GGMLQuantizationType.MXFP4 if name.endswith("_blocks") else None
        suffix = ".bias" if name.endswith("_bias") else ".weight"
        parts = {"down_proj": blocks} if stem.endswith("down_proj") else {
            "gate_proj": blocks[:, 0::2], "up_proj": blocks[:, 1::2]}  # fmt: skip
        for part, data in parts.items():
            gguf_name = _gguf_name(table, stem.rsplit(".", 1)[0] + f".{part}{suffix}")
            writer.add_tensor(gguf_name, np.ascontiguousarray(data), raw_dtype=kind)
    return rest


def _rope_factors(config: dict) -> dict[str, list[float]]:
    """Llama 3's scaling as each frequency's divisor (`rope_freqs`), computed as llama.cpp's
    converter does; Phi-3's longrope factor lists as they are."""
    rope, _ = rope_parameters(config)
    if rope.get("rope_type") == "longrope":
        return {"rope_factors_long.weight": rope["long_factor"],
                "rope_factors_short.weight": rope["short_factor"]}  # fmt: skip
    if rope.get("rope_type") != "llama3":
        return {}
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    original, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / dim)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": factors}


def _gguf_name(table: gguf.TensorNameMap, name: str) -> str:
    found = table.get_name(name, try_suffixes=(".weight", ".bias"))
    assert found is not None, f"gguf has no name for {name}"
    return found


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary order: each head's two halves interleaved."""
    shape = weight.shape
    return (
        weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _write_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    writer.add_name(config["model_type"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config.get("head_dim") or hidden // heads)
    writer.add_value_length(config.get("head_dim") or hidden // heads)
    writer.add_rope_dimension_count(rotary_dim(config) or config.get("head_dim") or hidden // heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(config.get("bos_token_id") or 1)
    writer.add_eos_token_id(config.get("eos_token_id") or 2)
    rope, local = rope_parameters(config)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        )
    if local:
        writer.add_rope_freq_base_swa(local["rope_theta"])
    windows = layer_windows(config)
    if windows:
        writer.add_sliding_window(max(windows))
    if windows and config["model_type"] != "gpt_oss":  # llama.cpp fixes gpt-oss's pattern
        writer.add_sliding_window_pattern([bool(w) for w in windows])
    if "query_pre_attn_scalar" in config:
        writer.add_attention_scale(config["query_pre_attn_scalar"] ** -0.5)
    if config["model_type"] == "granite":
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key):
            writer.add_float32(f"{writer.arch}.{key}", config[key])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config or config["model_type"] == "gpt_oss":
            inner = config.get("moe_intermediate_size") or config["intermediate_size"]
            writer.add_expert_feed_forward_length(inner)
        if "norm_topk_prob" in config:
            writer.add_expert_weights_norm(config["norm_topk_prob"])
