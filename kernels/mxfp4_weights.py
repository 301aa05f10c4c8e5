"""MXFP4 (the OCP microscaling format gpt-oss's experts ship in): 4-bit e2m1 codes, two a byte
(the low nibble first), and a shared power-of-two scale each 32 of them (an e8m0 byte, biased by
127). Dequantized at load into bfloat16, which holds every such value exactly (a bit of
mantissa, and fp32's exponents, subnormals down to 2^-133) in half float32's memory: gpt-oss-20b's
experts are 19 billion values. No kernel here multiplies MXFP4 codes."""

from __future__ import annotations

import torch

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
