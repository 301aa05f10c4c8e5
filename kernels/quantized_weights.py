"""Weights kept in their GGUF blocks: each weight is `d * code + m`, one fp16 scale d and offset
m per block of 32 inputs of an output feature, codes of 4 bits (Q4_0, Q4_1) or 8 (Q8_0, stored
as the int8 plus 128). The values are exactly the file's dequantized ones.

`QuantizedWeight` is the model's view while it loads (rows can be picked, reordered and stacked,
as the model does with dense weights); `pack` lays it out as `kernels/native/quantized*.c` and
an embedding's lookup read it (`PackedWeight`).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

BLOCK = 32  # inputs per block, as in quantized.h
PANEL = 16  # output features per panel

Q = gguf.GGMLQuantizationType
BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8}  # the GGUF block types kept as they are


@dataclass(slots=True, frozen=True)
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [out, in], one code a byte until packed
    scale: torch.Tensor  # float16 [out, in / 32]
    offset: torch.Tensor  # float16 [out, in / 32]
    bits: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def __getitem__(self, rows: slice | torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight(self.codes[rows], self.scale[rows], self.offset[rows], self.bits)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stacked by rows (q, k and v; gate and up), in one format."""
        if len({part.bits for part in parts}) != 1:
            raise ValueError("stacked quantized weights must share one code width")
        return QuantizedWeight(
            *(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "offset")),
            parts[0].bits,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, inputs = self.codes.shape
        blocks = self.codes.view(out, inputs // BLOCK, BLOCK).float()
        values = blocks * self.scale.float()[..., None] + self.offset.float()[..., None]
        return values.view(out, inputs).to(dtype)


def from_gguf(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> QuantizedWeight:
    """A GGUF tensor's raw blocks ([rows, bytes], as `GGUFReader` gives them) unpacked."""
    rows = data.shape[0]
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1, block_bytes)
    d = raw[..., :2].copy().view(np.float16)[..., 0]
    if kind == Q.Q8_0:
        codes = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        m = (d.astype(np.float32) * -128).astype(np.float16)
    else:
        nibbles = raw[..., 4:] if kind == Q.Q4_1 else raw[..., 2:]
        codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1)  # llama.cpp's order
        m = raw[..., 2:4].copy().view(np.float16)[..., 0] if kind == Q.Q4_1 else d * np.float16(-8)
    if not (np.isfinite(m).all() and np.isfinite(d).all()):
        raise ValueError(f"a {kind.name} block's scale overflows float16 once offset")
    return QuantizedWeight(
        torch.from_numpy(codes.reshape(rows, -1)),
        torch.from_numpy(np.ascontiguousarray(d)),
        torch.from_numpy(np.ascontiguousarray(m)),
        BITS[kind],
    )


@dataclass(slots=True, frozen=True)
class PackedWeight:
    """A `QuantizedWeight` in panels of 16 features (zero rows pad the last), each block of 32
    inputs as quantized.h lays it out: 8 groups of 16 features x 4 inputs (4-bit: groups c and
    c + 4 in the low and high nibbles of one), then the 16 scales and the 16 offsets as fp16.
    What the native product reads, and (an embedding) where rows are looked up: one copy."""

    panels: torch.Tensor  # uint8 [panels, blocks, block bytes]
    bits: int
    shape: tuple[int, int]  # [out, in]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` dequantized: an embedding's lookup."""
        count, groups = len(ids), 4 if self.bits == 4 else 8
        codes_end = PANEL * BLOCK * self.bits // 8
        panels, lane, each = self.panels[ids // PANEL], ids % PANEL, torch.arange(count)
        # Each row's lane of its panel: [rows, blocks, groups, 4] codes, [rows, blocks, 2] fp16.
        codes = panels[..., :codes_end].view(count, -1, groups, PANEL, 4).permute(0, 3, 1, 2, 4)
        codes = codes[each, lane]
        if self.bits == 4:
            codes = torch.cat((codes & 0x0F, codes >> 4), dim=2)
        scales = panels[..., codes_end:].view(torch.float16).view(count, -1, 2, PANEL)
        scale, offset = scales.permute(0, 3, 1, 2)[each, lane].float().unbind(-1)
        values = codes.reshape(count, -1, BLOCK).float() * scale[..., None] + offset[..., None]
        return values.view(count, -1).to(dtype)


def pack(weight: QuantizedWeight) -> PackedWeight:
    out, inputs = weight.codes.shape
    panels, blocks = -(-out // PANEL), inputs // BLOCK

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t, t.new_zeros(panels * PANEL - out, t.shape[1])))

    codes = padded(weight.codes).view(panels, PANEL, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    if weight.bits == 4:
        codes = codes[:, :, :4] | (codes[:, :, 4:] << 4)
    scales = [
        padded(t).view(panels, PANEL, blocks).transpose(1, 2).contiguous().view(torch.uint8)
        for t in (weight.scale, weight.offset)
    ]
    packed = torch.cat((codes.reshape(panels, blocks, -1), *scales), dim=-1).contiguous()
    return PackedWeight(packed, weight.bits, (out, inputs))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As quantized.c: per block of 32, dx = max|x| / 127, codes round(x / dx) (to nearest
    even), and dx times their sum; ([rows, blocks, 32] codes as float, dx, sums)."""
    blocks = x.float().view(x.shape[0], -1, BLOCK)
    dx = blocks.abs().amax(-1) / 127
    inverse = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    codes = torch.round(blocks * inverse[..., None])
    return codes, dx, dx * codes.sum(-1)


def reference_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """`x @ weight.T` as the native quantized product computes it, in torch: each block's
    integer sum (exact in float32) times d * dx, plus m times dx * the codes' sum."""
    codes, dx, sx = quantize_activations(x)
    out, inputs = weight.codes.shape
    sums = torch.einsum(
        "mbk,nbk->mnb", codes, weight.codes.view(out, inputs // BLOCK, BLOCK).float()
    )
    scale, offset = weight.scale.float()[None], weight.offset.float()[None]
    return (sums * scale * dx[:, None] + offset * sx[:, None]).sum(-1)
