"""Model weights as a Hugging Face-named state dict, from a safetensors directory or a GGUF file.

A GGUF file is dequantized once and cached as safetensors next to the user's cache, so every
later start maps the file instead of dequantizing for seconds; or, with `quantized`, its
Q4_0/Q4_1/Q8_0/Q4_K/Q6_K matrices are kept in their blocks (`kernels/gguf_blocks.py`). A GPTQ,
AWQ or compressed-tensors checkpoint's int matrices are unpacked (`kernels/packed_checkpoints.py`),
kept quantized alike with `quantized`; fp8 and bitsandbytes matrices are dequantized.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from turnstile.executor_svc.model.checkpoint_names import Weights, common_names, split_fused
from turnstile.executor_svc.model.gguf_tensors import Tensor, gguf_tensors
from turnstile.executor_svc.model.load_progress import LoadProgress
from turnstile.kernels.bitsandbytes_weights import dequantized as bitsandbytes_dequantized
from turnstile.kernels.gguf_blocks import Unkept, from_gguf
from turnstile.kernels.packed_checkpoints import Grouped, awq, compressed, gptq, int8_codes
from turnstile.kernels.quantized_weights import BITS, QuantizedWeight
from turnstile.shared.derived_files import derived_path, write_derived
from turnstile.shared.model_info import ModelInfo
from turnstile.shared.model_support import PERMUTED_ARCHITECTURES

log = logging.getLogger(__name__)

# The names the model reads, in the order a GGUF name is claimed: Llama's `ffn_norm` is its
# post-attention norm, Gemma's (whose post-attention norm has a name of its own) the MLP's input.
_LAYER_NAMES = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm",
    *(f"self_attn.{p}_proj" for p in "qkvo"), "self_attn.qkv_proj", "self_attn.sinks",
    *(f"mlp.{p}_proj" for p in ("gate", "up", "down")), "mlp.gate",
    *(f"mlp.experts.{p}_proj" for p in ("gate", "up", "down")),
)  # fmt: skip
_GLOBAL_NAMES = ("model.embed_tokens", "model.norm", "lm_head")
_STACKED_EXPERTS = ".mlp.experts."  # GGUF stacks every expert's matrix in one tensor
# RoPE factors, read with the model's shape (`gguf_info.py`), not weights.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def load_weights(path: Path, info: ModelInfo, quantized: bool = False) -> Weights:
    """With `quantized`, a GGUF file's matrices of the kept block types, or a GPTQ or AWQ
    checkpoint's, stay quantized (every other tensor is dequantized); without, every tensor is
    float32."""
    if path.suffix != ".gguf":
        files = _safetensors_files(path)
        weights: Weights = {}
        progress = LoadProgress(path.name, len(files), "files")
        for done, file in enumerate(files, 1):
            weights.update(load_file(file))
            progress.advance(done)
        return common_names(_unpacked(weights, info, quantized), info, quantized)
    if quantized:
        return read_gguf(path, info, quantized=True)
    cached = derived_path(path, "weights.safetensors", (__file__,))
    if cached.exists():
        return load_file(cached)
    weights = read_gguf(path, info)
    if write_derived(cached, lambda partial: _save(weights, partial)):
        log.info("cached dequantized weights in %s", cached)
    return weights


def _save(weights: dict[str, torch.Tensor], path: Path) -> None:
    """Streamed to the file (a model's bytes are not built in memory first: 4x faster)."""
    try:
        save_file(weights, path)
    except SafetensorError as error:  # a full disk, as the cache expects it
        raise OSError(str(error)) from error


def _safetensors_files(folder: Path) -> list[Path]:
    """The shards the index names, where the folder has one (Mistral's repositories also hold
    `consolidated.safetensors`, the same weights under Mistral's own names); else every file."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = [
            folder / name
            for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))
        ]
        missing = [file.name for file in files if not file.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shards not in the folder: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return files


def _unpacked(weights: Weights, info: ModelInfo, keep: bool) -> Weights:
    """A GPTQ, AWQ or compressed-tensors checkpoint's int matrices under `.weight`: with `keep`,
    quantized where their groups allow (not experts: they compute on dense weights); else
    float32 values, as fp8 matrices always are."""
    if info.weight_type == "float":
        return _fp8_values(weights, info.weight_block)
    if info.quantization == "bitsandbytes":
        return _bitsandbytes_values(weights)
    if info.quantization in ("", "mxfp4"):  # MXFP4: gpt-oss's experts (`checkpoint_names`)
        return weights
    read = _compressed if info.quantization == "compressed-tensors" else _gptq_awq
    dense = 0
    for stem, grouped in read(weights, info):
        kept = grouped.kept() if keep and ".experts." not in stem else None
        dense += keep and kept is None
        weights[stem + "weight"] = grouped.values() if kept is None else kept
    if dense:
        log.info("%d %s matrices dequantized (experts, act-order or narrow groups)", dense,
                 info.quantization.upper())  # fmt: skip
    return weights


def _gptq_awq(weights: Weights, info: ModelInfo) -> Iterator[tuple[str, Grouped]]:
    for name in [n for n in weights if n.endswith(".qweight")]:
        stem = name.removesuffix("qweight")
        parts = {part: weights.pop(stem + part, None) for part in ("qzeros", "scales", "g_idx")}
        if parts["scales"] is None or (info.quantization == "awq" and parts["qzeros"] is None):
            raise ValueError(f"{name} comes without its scales or zeros")
        if info.quantization == "awq":
            yield stem, awq(weights.pop(name), parts["qzeros"], parts["scales"])
        else:
            yield stem, gptq(weights.pop(name), parts["scales"], parts["g_idx"], info.weight_bits)


def _compressed(weights: Weights, info: ModelInfo) -> Iterator[tuple[str, Grouped]]:
    """Each module with a `weight_scale`: packed codes, or int8 ones under `weight`; the
    activations' scales are not read."""
    for name in [n for n in weights if n.endswith(".weight_scale")]:
        stem = name.removesuffix("weight_scale")
        scales, zeros, g_idx, shape, _, _ = (weights.pop(stem + part, None) for part in (
            "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "input_scale",
            "input_zero_point"))  # fmt: skip
        bits, group = info.weight_bits, info.weight_group
        if shape is not None and stem + "weight_packed" in weights:
            packed = weights.pop(stem + "weight_packed")
            yield stem, compressed(packed, scales, zeros, g_idx, shape.tolist(), bits, group)
        elif weights[stem + "weight"].dtype == torch.int8:
            yield stem, int8_codes(weights[stem + "weight"], scales, zeros, g_idx, group, bits)
        else:
            raise ValueError(f"{name} scales neither packed nor int8 codes")


def _fp8_values(weights: Weights, block: tuple[int, ...]) -> Weights:
    """fp8 checkpoints' e4m3 matrices times their scales, in float32: a tensor's or a row's
    (`weight_scale`), or each block's of `block` outputs by inputs (vLLM's `weight_scale_inv`,
    compressed-tensors' `weight_scale`; the last blocks of a row or column partial). No backend
    computes on fp8 weights."""
    for name in [
        n for n in weights if n.endswith(".weight_scale_inv") or n.endswith(".weight_scale")
    ]:
        stem = name.rsplit(".", 1)[0]
        scale, weight = weights.pop(name).float(), weights[stem + ".weight"].float()
        weights.pop(stem + ".input_scale", None)  # activations stay in the model's dtype
        if block:
            rows, cols = block
            scale = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
            scale = scale[: weight.shape[0], : weight.shape[1]]
        weights[stem + ".weight"] = weight * scale
    log.info("fp8 weights dequantized (no backend computes on them)")
    return weights


def _bitsandbytes_values(weights: Weights) -> Weights:
    """bitsandbytes' 4-bit matrices (`kernels/bitsandbytes_weights.py`) in float32: no kernel
    here multiplies NF4 or FP4 codes."""
    for name in [n for n in weights if ".weight.quant_state.bitsandbytes__" in n]:
        stem = name.split(".quant_state.")[0]
        state = json.loads(weights.pop(name).numpy().tobytes())
        names = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
        parts = {part: weights.pop(f"{stem}.{part}", None) for part in names}
        if parts["absmax"] is None or parts["quant_map"] is None:
            raise ValueError(f"{stem} comes without its absmax or quant_map")
        weights[stem] = bitsandbytes_dequantized(weights[stem], state=state, **parts)
    log.info("bitsandbytes weights dequantized (no backend computes on 4-bit codes)")
    return weights


def read_gguf(path: Path, info: ModelInfo, quantized: bool = False) -> Weights:
    arch, tensors = gguf_tensors(path)
    names = _hf_names(arch, info.num_layers)
    weights: Weights = {}
    progress = LoadProgress(path.name, len(tensors), "tensors")
    for done, tensor in enumerate(tensors):
        progress.advance(done)
        if tensor.name in _ROPE_TENSORS:
            continue
        if tensor.name not in names:
            raise ValueError(f"unexpected GGUF tensor {tensor.name!r}")
        name = names[tensor.name]
        stacked = _STACKED_EXPERTS in name
        value: torch.Tensor | QuantizedWeight | list[QuantizedWeight] | None
        kind, data = tensor.tensor_type, tensor.data
        value = _kept(tensor, stacked) if quantized and kind in BITS else None
        if value is None:
            values = gguf.quants.dequantize(data, kind)
            value = torch.from_numpy(np.ascontiguousarray(values.astype(np.float32)))
        if stacked:
            for expert, matrix in enumerate(value):
                weights[name.replace(_STACKED_EXPERTS, f"{_STACKED_EXPERTS}{expert}.")] = matrix
            continue
        if arch in PERMUTED_ARCHITECTURES and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = value[_rope_order(value.shape[0], info.num_heads)]
        elif arch in PERMUTED_ARCHITECTURES and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = value[_rope_order(value.shape[0], info.num_kv_heads)]
        weights[name] = value
    progress.advance(len(tensors))
    return split_fused(weights, info)


def _kept(tensor: Tensor, stacked: bool) -> QuantizedWeight | list[QuantizedWeight] | None:
    """A tensor's blocks (a stacked one's, each expert's); None where they cannot be kept."""
    try:
        if stacked:
            return [from_gguf(matrix, tensor.tensor_type) for matrix in tensor.data]
        return from_gguf(tensor.data, tensor.tensor_type)
    except Unkept as why:
        log.warning("%s dequantized: %s", tensor.name, why)
        return None


def _hf_names(arch: str, layers: int) -> dict[str, str]:
    """GGUF tensor name -> the name the model reads, by gguf's own table of what each
    architecture's tensors were converted from."""
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    table = gguf.get_tensor_name_map(model_arch, layers)
    names: dict[str, str] = {}
    # llama.cpp keeps Phi-3's gate and up fused as its `ffn_up`: claimed before `up_proj`
    first = ("mlp.gate_up_proj",) if arch == "phi3" else ()
    per_layer = (
        f"model.layers.{i}.{name}" for i in range(layers) for name in (*first, *_LAYER_NAMES)
    )
    for hf in (*_GLOBAL_NAMES, *per_layer):
        found = table.get_name(hf)
        if found is not None and hf.endswith(".sinks"):  # gpt-oss's: llama.cpp adds `.weight`
            names[found + ".weight"] = hf
        elif found is not None:
            for suffix in (".weight", ".bias"):
                names.setdefault(found + suffix, hf + suffix)
    return names


def _rope_order(rows: int, num_heads: int) -> torch.Tensor:
    """The rows in Hugging Face's order: llama.cpp interleaves each head's rotary halves."""
    order = torch.arange(rows).view(num_heads, rows // num_heads // 2, 2)
    return order.transpose(1, 2).reshape(-1)
