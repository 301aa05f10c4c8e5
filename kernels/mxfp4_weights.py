"""MXFP4 (the OCP microscaling format gpt-oss's experts ship in): 4-bit e2m1 codes, two a byte
(the low nibble first), and a shared power-of-two scale each 32 of them (an e8m0 byte, biased by
127). Kept as they are for the cpu backend's experts (`mxfp4_blocks`: quantized.h's QFP4, 4.5
bits a weight), or dequantized into bfloat16, which holds every such value exactly (a bit of
mantissa, and fp32's exponents, subnormals down to 2^-133) in half float32's memory:
gpt-oss-20b's experts are 19 billion values."""

from __future__ import annotations

import torch

from turnstile.kernels.quantized_weights import FP4, FP4_CODES, QuantizedWeight

# e2m1's 16 values: sign, two exponent bits, one mantissa bit.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_values(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`blocks` [..., groups, 16] uint8 and `scales` [..., groups] uint8 as bfloat16 [...,
    groups * 32]: each group's 32 codes times 2^(scale - 127), exactly; a leading slice at a
    time (an expert's), so that the float32 transients are one slice's."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair"
        )
    if blocks.dim() > 3:
        out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=torch.bfloat16)
        for i, (part, scale) in enumerate(zip(blocks, scales, strict=True)):
            out[i] = mxfp4_values(part, scale)
        return out
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = blocks.to(torch.uint8).long()
    values = torch.stack((table[codes & 0x0F], table[codes >> 4]), dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(torch.bfloat16)


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight | None:
    """`blocks` [rows, groups, 16] uint8 and `scales` [rows, groups] uint8 kept: each code read
    as 2 e2m1 + 12 (0-24), d = 2^(scale - 128) and m = -12 d in float16; None where a block's d
    or m is not a float16 exactly (scales outside 2^-23 to 2^13)."""
    nibbles = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-3)
    return fp4_weight(nibbles, scales)


def fp4_weight(nibbles: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight | None:
    """e2m1 codes [rows, inputs] in element order and their blocks' e8m0 `scales` [rows,
    groups] as `mxfp4_blocks` keeps them; None where float16 does not hold d and m exactly."""
    d = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 128)
    scale, offset = d.half(), (-12 * d).half()
    if not (torch.equal(scale.float(), d) and torch.equal(offset.float(), -12 * d)):
        return None
    return QuantizedWeight(FP4_CODES[nibbles.long()], scale, offset, FP4)
