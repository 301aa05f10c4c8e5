"""bitsandbytes' 4-bit weights (NF4 or FP4), as transformers saves a model quantized with
`BitsAndBytesConfig(load_in_4bit=True)`, dequantized as bitsandbytes dequantizes them: each
weight is `quant_map[code] * absmax` of its block of `blocksize` consecutive weights of the
row-major matrix, the codes two a byte (the first in the high nibble). With double quantization
the absmax are themselves 8-bit codes: `nested_quant_map[code] * nested_absmax` of their block of
`nested_blocksize`, plus `nested_offset`. Values are float32, as bitsandbytes computes them
before casting to its compute dtype."""

from __future__ import annotations

from typing import Any

import torch


def dequantized(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_map: torch.Tensor,
    state: dict[str, Any],
    nested_absmax: torch.Tensor | None = None,
    nested_quant_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [out, in] from the packed codes, the block scales and the quant state (the JSON
    that `weight.quant_state.bitsandbytes__nf4` holds)."""
    if "nested_blocksize" in state:
        if nested_absmax is None or nested_quant_map is None:
            raise ValueError("a double-quantized weight comes without its nested absmax")
        absmax = _blocks(nested_quant_map.float()[absmax.long()], nested_absmax,
                         state["nested_blocksize"]) + state["nested_offset"]  # fmt: skip
    shape = state["shape"]
    count = shape[0] * shape[1]
    bytes_ = packed.view(torch.uint8).flatten()
    codes = torch.stack([bytes_ >> 4, bytes_ & 0xF], dim=1).flatten()[:count]
    values = _blocks(quant_map.float()[codes.long()], absmax.float(), state["blocksize"])
    return values.view(shape[0], shape[1])


def _blocks(values: torch.Tensor, scales: torch.Tensor, size: int) -> torch.Tensor:
    """Each run of `size` values times its scale (the last run partial)."""
    if scales.numel() != -(-values.numel() // size):
        raise ValueError(f"{scales.numel()} scales for {values.numel()} values in blocks of {size}")
    return values * scales.float().repeat_interleave(size)[: values.numel()]
