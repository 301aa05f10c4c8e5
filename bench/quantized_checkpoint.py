"""Writes a float Hugging Face checkpoint's decoder projections as a GPTQ or AWQ checkpoint, in the
layouts AutoGPTQ and AutoAWQ write, each group rounded to nearest (no calibration: the layout is
what is under test, not the method's accuracy), or as vLLM's fp8 (e4m3, a scale a tensor, or a
block of GROUP x GROUP), for the tests and the side-by-side with vLLM:
    .venv/bin/python -m turnstile.bench.quantized_checkpoint SOURCE DEST gptq|awq|fp8 [BITS] [GROUP]
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

# The decoder's projections (Phi-3's fused ones too); embeddings, norms and the head stay float.
PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w*proj\.weight$")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble i (lowest first) holds output i's


def write(
    source: Path,
    dest: Path,
    method: str,
    bits: int = 4,
    group: int = 128,
    act_order: bool = False,
) -> dict[str, torch.Tensor]:
    """`source`'s checkpoint in `dest`, its projections quantized by `method` (gptq: symmetric;
    awq: with zero points) in groups of `group` inputs (-1: a row); `act_order` (GPTQ): each
    input's group drawn at random, as desc_act leaves them; fp8: `bits` unused, a scale for
    each block of `group` outputs by inputs (-1: one a tensor). Returns the projections'
    values as quantized (float32), for a reference model."""
    dest.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(file))
    written, values = {}, {}
    for name, tensor in tensors.items():
        if not PROJECTION.match(name):
            written[name] = tensor
            continue
        stem = name.removesuffix("weight")
        if method == "fp8":
            parts, values[name] = _fp8(tensor.float(), group)
        else:
            parts, values[name] = _quantize(tensor.float(), method, bits, group, act_order)
        written.update({stem + part: t for part, t in parts.items()})
    for file in source.iterdir():
        if file.is_file() and not file.name.startswith("model") and file.name != "config.json":
            shutil.copy(file, dest / file.name)
    save_file(written, dest / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "gptq": {"quant_method": "gptq", "bits": bits, "group_size": group,
                 "desc_act": act_order, "sym": True, "checkpoint_format": "gptq"},
        "awq": {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True,
                "version": "gemm"},
        "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                **({"weight_block_size": [group, group]} if group > 0 else {})},
    }[method]  # fmt: skip
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return values


def _quantize(
    weight: torch.Tensor, method: str, bits: int, group: int, act_order: bool
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, inputs = weight.shape
    width = inputs if group == -1 else group
    groups = torch.arange(inputs) // width
    if act_order:
        groups = groups[torch.randperm(inputs, generator=torch.Generator().manual_seed(out))]
    top = (1 << bits) - 1
    codes = torch.empty(out, inputs)
    scales = torch.empty(inputs // width, out, dtype=torch.float16)
    zeros = torch.empty(inputs // width, out)
    for g in range(inputs // width):
        w = weight[:, groups == g]
        if method == "gptq":  # symmetric about 2 ** (bits - 1)
            scale = (2 * w.abs().amax(1) / top).half()
            zero = torch.full((out,), float(1 << (bits - 1)))
        else:
            low, high = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
            scale = ((high - low) / top).half()
            zero = torch.round(-low / scale.float()).clamp(0, top)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes[:, groups == g] = (w / scale.float()[:, None] + zero[:, None]).round().clamp(0, top)
        scales[g], zeros[g] = scale, zero
    values = (codes - zeros.T[:, groups]) * scales.float().T[:, groups]
    if method == "gptq":
        parts = {
            "qweight": _pack(codes.T.reshape(inputs * bits // 32, 32 // bits, out), bits, 1),
            # AutoGPTQ's v1 format stores each zero less one
            "qzeros": _pack((zeros - 1).reshape(-1, out // (32 // bits), 32 // bits), bits, 2),
            "scales": scales,
            "g_idx": groups.to(torch.int32),
        }
    else:
        order = list(AWQ_PACK_ORDER)
        parts = {
            "qweight": _pack(codes.T.reshape(inputs, out // 8, 8)[..., order], 4, 2),
            "qzeros": _pack(zeros.reshape(-1, out // 8, 8)[..., order], 4, 2),
            "scales": scales,
        }
    return parts, values


def _fp8(weight: torch.Tensor, block: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """e4m3 codes of each block scaled to the format's largest (448), as vLLM's checkpoints."""
    if block <= 0:
        scale = weight.abs().amax() / 448
        codes = (weight / scale).to(torch.float8_e4m3fn)
        return {"weight": codes, "weight_scale": scale.reshape(1)}, codes.float() * scale
    rows, cols = (-(-size // block) for size in weight.shape)
    padded = torch.zeros(rows * block, cols * block)
    padded[: weight.shape[0], : weight.shape[1]] = weight
    blocks = padded.view(rows, block, cols, block)
    scales = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    each = scales.repeat_interleave(block, 0).repeat_interleave(block, 1)
    each = each[: weight.shape[0], : weight.shape[1]]
    codes = (weight / each).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": scales}, codes.float() * each


def _pack(fields: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Along `dim`, 32 / bits fields into one int32, the first in the lowest bits."""
    shifts = np.arange(fields.shape[dim], dtype=np.uint64) * bits
    shape = [1] * fields.dim()
    shape[dim] = -1
    words = (fields.numpy().astype(np.uint64) << shifts.reshape(shape)).sum(axis=dim)
    return torch.from_numpy(np.ascontiguousarray(words.astype(np.uint32).view(np.int32)))


if __name__ == "__main__":
    source, dest, method, *rest = sys.argv[1:]
    write(Path(source), Path(dest), method, *(int(x) for x in rest))
    print(f"wrote {dest}")
