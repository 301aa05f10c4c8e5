"""Model weights as a Hugging Face-named state dict, from a safetensors directory or a GGUF file.

A GGUF file is dequantized once and cached as safetensors next to the user's cache, so every
later start maps the file instead of dequantizing for seconds; or, with `quantized`, read as
the model takes each tensor, its Q4_0/Q4_1/Q8_0/Q4_K/Q6_K/MXFP4 matrices kept in their blocks
(`gguf_weights.py`). A GPTQ,
AWQ or compressed-tensors checkpoint's int matrices are unpacked (`kernels/packed_checkpoints.py`),
kept quantized alike with `quantized`; fp8 and bitsandbytes matrices are dequantized.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from turnstile.executor_svc.model import gguf_weights
from turnstile.executor_svc.model.checkpoint_names import Weights, common_names
from turnstile.executor_svc.model.gguf_weights import GGUFWeights, read_gguf
from turnstile.executor_svc.model.load_progress import LoadProgress
from turnstile.kernels.bitsandbytes_weights import dequantized as bitsandbytes_dequantized
from turnstile.kernels.packed_checkpoints import Grouped, awq, compressed, gptq, int8_codes
from turnstile.shared.derived_files import derived_path, write_derived
from turnstile.shared.model_info import ModelInfo

log = logging.getLogger(__name__)


def load_weights(path: Path, info: ModelInfo, quantized: bool = False) -> Weights | GGUFWeights:
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
    cached = derived_path(path, "weights.safetensors", (__file__, gguf_weights.__file__))
    if cached.exists():
        return load_file(cached)
    weights = dict(read_gguf(path, info))
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
