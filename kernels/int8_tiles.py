"""Weights for the AMX-INT8 tiles (`kernels/native/int8_tiles.c`, `--cpu-products tiles`): a
projection's values requantized to int8 with one scale per output feature, laid out as the
tiles' B operand; and the product's torch reference, bit for bit.

Rows are quantized to 16 bits with one scale each, so the integer sums run over all of K inside
the tiles; GGUF's scales per 32 inputs would take them out every block (docs/benchmarks.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnstile.kernels.native_structs import NativeWeight

PANEL = 16  # output features a tile
QUAD = 64  # inputs a tile: 16 rows of 4


@dataclass(slots=True, frozen=True)
class Int8Tiles:
    tiles: torch.Tensor  # int8 [panels, quads, 16 (input quad), 16 (feature), 4]
    scales: torch.Tensor  # float32 [panels * 16], zero past the last feature
    shape: tuple[int, int]  # [out, in]

    @staticmethod
    def from_values(values: torch.Tensor) -> Int8Tiles:
        """`values` [out, in] (float32) as codes round(w / s), s = max|w| / 127 a feature."""
        out, inputs = values.shape
        if inputs % PANEL:
            raise ValueError(f"int8 tiles need inputs in multiples of {PANEL}, not {inputs}")
        panels, quads = -(-out // PANEL), -(-inputs // QUAD)
        scale = values.abs().amax(dim=1) / 127
        codes = torch.round(values / torch.where(scale > 0, scale, 1)[:, None]).to(torch.int8)
        padded = codes.new_zeros(panels * PANEL, quads * QUAD)
        padded[:out, :inputs] = codes
        tiles = padded.view(panels, PANEL, quads, PANEL, 4).permute(0, 2, 3, 1, 4).contiguous()
        scales = torch.zeros(panels * PANEL)
        scales[:out] = scale
        return Int8Tiles(tiles, scales, (out, inputs))

    def faithful(self, values: torch.Tensor) -> bool:
        """Whether these codes keep `values`: at most 1% of its groups of 32 inputs a feature
        lose over 5% of their RMS. Trained weights lose ~1% (their groups' ranges are alike
        along a feature); where a feature's groups span orders of magnitude, the small ones
        keep few levels, and the GGUF blocks are kept instead (docs/benchmarks.md)."""
        out, inputs = self.shape
        groups = (out, inputs // 32, -1) if inputs % 32 == 0 else (out, 1, -1)
        error = (self.dequantize() - values).reshape(groups).pow(2).mean(dim=2)
        lost = error > 0.05**2 * values.reshape(groups).pow(2).mean(dim=2)
        return lost.float().mean().item() <= 0.01

    def codes(self) -> torch.Tensor:
        """The int8 codes as [out, in]."""
        out, inputs = self.shape
        panels, quads = self.tiles.shape[:2]
        rows = self.tiles.permute(0, 3, 1, 2, 4).reshape(panels * PANEL, quads * QUAD)
        return rows[:out, :inputs]

    def native_weight(self) -> NativeWeight:
        """As the native products take it (kept alive by its holder with these tensors)."""
        return NativeWeight(self.tiles.data_ptr(), 8, self.shape[0], scales=self.scales.data_ptr())

    def dequantize(self) -> torch.Tensor:
        return self.codes().float() * self.scales[: self.shape[0], None]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's 16-bit codes round(x / s), s = max|x| / 32767, and s, as int8_tiles.c."""
    scale = x.abs().amax(dim=1) / 32767
    inverse = torch.where(scale > 0, 1 / scale, 0)
    return torch.round(x * inverse[:, None]).clamp(-32767, 32767).to(torch.int64), scale


def reference_linear(x: torch.Tensor, weight: Int8Tiles) -> torch.Tensor:
    """The tiles' product in torch: exact integer sums of the codes' high and low bytes, then
    (256 S_hi + S_lo) (sx sw) in float32."""
    codes, sx = quantize_rows(x.float())
    w = weight.codes().to(torch.int64).T
    high, low = (codes >> 8) @ w, (codes & 255) @ w
    total = high.float() * 256 + low.float()
    return total * (sx[:, None] * weight.scales[: weight.shape[0]])
