"""Weights kept in their GGUF blocks: each weight is `d * code + m`, one fp16 scale d and offset
m per group of inputs of an output feature: groups of 32 with codes of 4 bits (Q4_0, Q4_1,
Q4_K) or 8 (Q8_0, stored as the int8 plus 128); Q6_K's groups of 16 with 6-bit codes and
m = -32 d; MXFP4's e2m1 codes (`FP4`) as 2 e2m1 + 12 with m = -12 d, stored in 4 bits.
`gguf_blocks.py` unpacks a file's blocks into this form, `mxfp4_weights.py` gpt-oss's.

`QuantizedWeight` is the model's view while it loads (rows can be picked, reordered and stacked,
as the model does with dense weights); `pack` lays it out as `kernels/native/quantized*.c` and
an embedding's lookup read it (`PackedWeight`).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

BLOCK = 32  # inputs per block, as in quantized.h
PANEL = 16  # output features per panel

Q = gguf.GGMLQuantizationType
# MXFP4's e2m1 codes (quantized.h's QFP4), kept as `2 e2m1 + 12` (0-24) with d half the block's
# power of two and m = -12 d, stored packed as 4-bit codes are: FP4_CODES[nibble] is its code.
FP4 = 5
FP4_CODES = torch.tensor(
    [12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0], dtype=torch.uint8
)
_NIBBLES = torch.zeros(25, dtype=torch.uint8).index_put_(
    (FP4_CODES.long(),), torch.arange(16, dtype=torch.uint8)
)
# The GGUF block types kept as they are, and their codes' width (6: Q6_K's layout).
BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8, Q.Q4_K: 4, Q.Q6_K: 6, Q.MXFP4: FP4}


@dataclass(slots=True, frozen=True)
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [out, in], one code a byte until packed
    scale: torch.Tensor  # float16 [out, in / group]
    offset: torch.Tensor  # float16 [out, in / group]
    bits: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def group(self) -> int:
        """Inputs a scale and an offset cover: 32, or 16 (Q6_K)."""
        return self.codes.shape[1] // self.scale.shape[1]

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
        groups = self.codes.view(out, -1, self.group).float()
        values = groups * self.scale.float()[..., None] + self.offset.float()[..., None]
        return values.view(out, inputs).to(dtype)


@dataclass(slots=True, frozen=True)
class StackedWeight:
    """Quantized weights stacked by rows in different formats (Q4_K_M files keep q and k in
    Q4_K, v in Q6_K): each part packed apart, the product one call over all of them."""

    parts: tuple[QuantizedWeight, ...]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([part.dequantize(dtype) for part in self.parts])


def stack(parts: list[QuantizedWeight]) -> QuantizedWeight | StackedWeight | None:
    """Stacked by rows: one weight where the formats agree, else runs of one format, each but
    the last a whole number of panels; None where a run is not."""
    runs: list[list[QuantizedWeight]] = []
    for part in parts:
        if runs and (runs[-1][0].bits, runs[-1][0].group) == (part.bits, part.group):
            runs[-1].append(part)
        else:
            runs.append([part])
    merged = [QuantizedWeight.cat(run) for run in runs]
    if len(merged) == 1:
        return merged[0]
    if any(part.shape[0] % PANEL for part in merged[:-1]):
        return None
    return StackedWeight(tuple(merged))


@dataclass(slots=True, frozen=True)
class PackedWeight:
    """A `QuantizedWeight` in panels of 16 features (zero rows pad the last), each block of 32
    inputs as quantized.h lays it out: 8 groups of 16 features x 4 inputs (4-bit: groups c and
    c + 4 in the low and high nibbles of one; 6-bit: so, then the 2 high bits of groups 4v to
    4v + 3 in one byte), then two fp16 vectors of 16: the scales and the offsets (6-bit: the
    scales of the block's first 16 inputs and of its last). What the native product reads, and
    (an embedding) where rows are looked up: one copy."""

    panels: torch.Tensor  # uint8 [panels, blocks, block bytes]
    bits: int
    shape: tuple[int, int]  # [out, in]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` dequantized: an embedding's lookup."""
        return self.unpack(ids).dequantize(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0]), dtype)

    def unpack(self, ids: torch.Tensor) -> QuantizedWeight:
        """Rows `ids` back in their unpacked form."""
        count, panel, lane = len(ids), ids // PANEL, ids % PANEL
        every = self.panels.shape[0]

        def lanes(start: int, end: int) -> torch.Tensor:  # each row's bytes: [rows, blocks, n, 4]
            # Only the rows' own lanes are gathered, not their panels' (16 times the bytes).
            return self.panels[..., start:end].view(every, blocks, -1, PANEL, 4)[panel, :, :, lane]

        blocks, nibbles = self.shape[1] // BLOCK, PANEL * BLOCK // 2
        if self.bits == 8:
            codes = lanes(0, 2 * nibbles)
        else:
            packed = lanes(0, nibbles)
            codes = torch.cat((packed & 0x0F, packed >> 4), dim=2)
        if self.bits == FP4:
            codes = FP4_CODES[codes.long()]
        if self.bits == 6:
            shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
            high = (lanes(nibbles, nibbles * 3 // 2)[:, :, :, None] >> shifts) & 3
            codes |= high.reshape(codes.shape) << 4
        end = PANEL * BLOCK * _stored_bits(self.bits) // 8
        pairs = self.panels[..., end:].view(torch.float16).view(every, blocks, 2, PANEL)
        pairs = pairs[panel, :, :, lane]
        scale, offset = pairs.reshape(count, -1), None  # 6-bit: both halves' scales, in order
        if self.bits != 6:
            scale, offset = pairs.unbind(-1)
        offset = scale * -32 if offset is None else offset
        return QuantizedWeight(codes.reshape(count, -1), scale, offset, self.bits)


def _stored_bits(bits: int) -> int:
    return 4 if bits == FP4 else bits


def pack(weight: QuantizedWeight) -> PackedWeight:
    out, inputs = weight.codes.shape
    panels, blocks = -(-out // PANEL), inputs // BLOCK

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t, t.new_zeros(panels * PANEL - out, t.shape[1])))

    codes = padded(weight.codes)
    if weight.bits == FP4:
        codes = _NIBBLES[codes.long()]
    codes = codes.view(panels, PANEL, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    parts = [codes]
    if weight.bits in (4, FP4, 6):
        low = codes & 0x0F
        parts = [low[:, :, :4] | (low[:, :, 4:] << 4)]
    if weight.bits == 6:
        high = (codes >> 4).reshape(panels, blocks, 2, 4, PANEL, 4)
        parts.append(
            high[:, :, :, 0] | high[:, :, :, 1] << 2 | high[:, :, :, 2] << 4 | high[:, :, :, 3] << 6
        )
    pair = (weight.scale, weight.offset)
    if weight.bits == 6:
        pair = (weight.scale[:, 0::2], weight.scale[:, 1::2])
    scales = [
        padded(t).view(panels, PANEL, blocks).transpose(1, 2).contiguous().view(torch.uint8)
        for t in pair
    ]
    codes_bytes = [part.reshape(panels, blocks, -1) for part in parts]
    packed = torch.cat((*codes_bytes, *scales), dim=-1).contiguous()
    return PackedWeight(packed, weight.bits, (out, inputs))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As quantized.c: per block of 32, dx = max|x| / 127 and the codes round(x / dx) (to
    nearest even); ([rows, blocks, 32] codes as float, dx)."""
    blocks = x.float().view(x.shape[0], -1, BLOCK)
    dx = blocks.abs().amax(-1) / 127
    inverse = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    return torch.round(blocks * inverse[..., None]), dx


def reference_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """`x @ weight.T` as the native quantized product computes it, in torch: each group's
    integer sum (exact in float32) times d * dx, plus m times dx * the codes' sum."""
    codes, dx = quantize_activations(x)
    group, out = weight.group, weight.codes.shape[0]
    codes = codes.view(len(x), -1, group)
    dx = dx.repeat_interleave(BLOCK // group, dim=1)
    sums = torch.einsum("mgk,ngk->mng", codes, weight.codes.view(out, -1, group).float())
    scale, offset = weight.scale.float()[None], weight.offset.float()[None]
    return (sums * scale * dx[:, None] + offset * (dx * codes.sum(-1))[:, None]).sum(-1)
