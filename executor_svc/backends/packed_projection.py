"""Projections on the native CPU kernels: dense weights stored once in panels of 16 output
features (`kernels/native/gemm.c`; against oneDNN with prepacked weights: docs/benchmarks.md),
GGUF blocks kept quantized in panels (`kernels/native/quantized*.c`), or their values
requantized to int8 on AMX tiles (`kernels/native/int8_tiles.c`)."""

from __future__ import annotations

import ctypes
import itertools

import torch

from turnstile.kernels import cpu_native
from turnstile.kernels.int8_tiles import Int8Tiles
from turnstile.kernels.native_structs import NativeWeight
from turnstile.kernels.quantized_weights import PackedWeight


class PackedProjection:
    """A projection on the native kernel, in float32 arithmetic whether the weight is float32
    or bfloat16 (widened in registers: half the bytes a token reads); or, `tiles`, a bfloat16
    weight's on AMX-BF16 tiles, the rows rounded to bf16 (`bf16_tiles.c`), in every route."""

    __slots__ = ("bias", "out_features", "packed", "tiles")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, tiles: bool = False
    ) -> None:
        self.out_features = weight.shape[0]
        self.packed = cpu_native.pack_weight(weight)  # the panels are all a forward needs
        self.bias = None if bias is None else bias.float()
        self.tiles = tiles

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The residual is added as each output is stored: no separate pass over memory."""
        packed, out, bias = self.packed, self.out_features, self.bias
        return cpu_native.linear(x, packed, out, bias, residual, self.tiles)

    def native_weight(self) -> NativeWeight:
        """The panels as the fused decode layers take them."""
        bits = 8 * self.packed.element_size()
        return NativeWeight(self.packed.data_ptr(), bits, self.out_features,
                                       tiles=self.tiles)  # fmt: skip


class QuantizedProjection:
    """A projection on a weight's GGUF blocks, the activations quantized to int8 per block;
    parts stacked by rows in different formats multiplied in one call."""

    __slots__ = ("_chain", "bias", "out_features", "parts")

    def __init__(self, parts: list[PackedWeight], bias: torch.Tensor | None) -> None:
        self.out_features = sum(part.shape[0] for part in parts)
        self.parts = parts  # a tied head's: shared with the embedding
        self.bias = None if bias is None else bias.float()
        # decode_layer.c's chained `Weight`s, kept alive with the panels they point at.
        self._chain = [
            NativeWeight(part.panels.data_ptr(), part.bits, part.shape[0]) for part in parts
        ]
        for part, below in itertools.pairwise(self._chain):
            part.next = ctypes.pointer(below)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_native.linear_weight(x, self._chain[0], self.out_features, self.bias, residual)

    def native_weight(self) -> NativeWeight:
        return self._chain[0]


class TiledProjection:
    """A projection on AMX-INT8 tiles (`--cpu-products tiles`): the weight requantized at load
    to int8 with a scale a feature, the activations to 16 bits a row."""

    __slots__ = ("_weight", "bias", "out_features", "tiles")

    def __init__(self, tiles: Int8Tiles, bias: torch.Tensor | None) -> None:
        self.out_features = tiles.shape[0]
        self.tiles = tiles
        self.bias = None if bias is None else bias.float()
        self._weight = tiles.native_weight()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_native.linear_weight(x, self._weight, self.out_features, self.bias, residual)

    def native_weight(self) -> NativeWeight:
        return self._weight


NativeProjection = PackedProjection | QuantizedProjection | TiledProjection
QUANTIZED = (QuantizedProjection, TiledProjection)
