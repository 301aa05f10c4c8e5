"""Writes a float Hugging Face checkpoint as llm-compressor does, through the compressed-tensors
library itself: the decoder's linear layers (the head left float) quantized by a preset's scheme,
each group, row or block rounded to nearest from its minimum and maximum (no calibration: the
layout is under test, not the method's accuracy), then compressed and saved by the library, for
the tests and the side-by-side with vLLM:
    .venv/bin/python -m turnstile.bench.compressed_checkpoint SOURCE DEST SCHEME [GROUP]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch

_INT8_TOKENS = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
_FP8_TOKENS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
# name: (weights' arguments, input activations' or None, format); GROUP fills group_size and
# block_structure. vLLM's names: W4A16, W4A16_ASYM, W8A16, W8A8, FP8_DYNAMIC, FP8_BLOCK.
SCHEMES: dict[str, tuple[dict[str, Any], dict[str, Any] | None, str]] = {
    "w4a16": ({"num_bits": 4, "strategy": "group"}, None, "pack-quantized"),
    "w4a16-asym": ({"num_bits": 4, "strategy": "group", "symmetric": False}, None,
                   "pack-quantized"),
    "w8a16": ({"num_bits": 8, "strategy": "channel"}, None, "pack-quantized"),
    "w8a8": ({"num_bits": 8, "strategy": "channel"}, _INT8_TOKENS, "int-quantized"),
    "fp8-dynamic": ({"num_bits": 8, "type": "float", "strategy": "channel"}, _FP8_TOKENS,
                    "float-quantized"),
    "fp8-block": ({"num_bits": 8, "type": "float", "strategy": "block"}, _FP8_TOKENS,
                  "float-quantized"),
}  # fmt: skip


def write(
    source: Path, dest: Path, scheme: str, group: int = 128, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """`source`'s checkpoint in `dest` (tensors in `dtype`, or the source's), compressed by the
    library; returns each quantized matrix's values as the library decompresses them, in
    float32 (a reference model loads them)."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM

    weights, inputs, form = SCHEMES[scheme]
    weights = {"type": "int", "symmetric": True, **weights}
    weights |= {"group_size": group} if weights["strategy"] == "group" else {}
    weights |= {"block_structure": [group, group]} if weights["strategy"] == "block" else {}
    config = QuantizationConfig.model_validate({
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": inputs}},
        "ignore": ["lm_head"], "format": form,
    })  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or "auto")
    apply_quantization_config(model, config)
    modules = {n: m for n, m in model.named_modules() if getattr(m, "quantization_scheme", None)}
    for module in modules.values():
        _set_qparams(module, module.quantization_scheme.weights)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=form)
    compressor.compress_model(model)
    model.save_pretrained(dest)
    compressor.update_config(str(dest))
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, dest / file.name)
    reader = BaseCompressor.load_from_registry(form)
    values = {}
    for name, module in modules.items():
        state = {k: v.float() if "scale" in k else v for k, v in module.state_dict().items()}
        values[name + ".weight"] = reader.decompress(state, module.quantization_scheme)["weight"]
    return {name: value.float() for name, value in values.items()}


def _set_qparams(module: torch.nn.Module, args: Any) -> None:
    """Scales and zero points from each group's, row's, tensor's or block's minimum and maximum,
    as the library's memoryless observer computes them."""
    from compressed_tensors.quantization.utils import calculate_qparams

    weight = module.weight.detach().float()
    out, inputs = weight.shape
    if args.strategy == "group":
        groups = weight.view(out, inputs // args.group_size, args.group_size)
        low, high = groups.amin(2), groups.amax(2)
    elif args.strategy == "block":
        rows, cols = args.block_structure
        blocks = weight.view(out // rows, rows, inputs // cols, cols)
        low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    else:
        dims = (1,) if args.strategy == "channel" else (0, 1)
        low, high = weight.amin(dim=dims, keepdim=True), weight.amax(dim=dims, keepdim=True)
    scale, zero = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))


if __name__ == "__main__":
    source, dest, scheme, *rest = sys.argv[1:]
    write(Path(source), Path(dest), scheme, *(int(x) for x in rest))
    print(f"wrote {dest}")
