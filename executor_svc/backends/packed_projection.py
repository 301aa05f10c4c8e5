"""Projections on the native CPU kernels: dense weights stored once in panels of 16 output
features (`kernels/native/gemm.c`; against oneDNN with prepacked weights: docs/benchmarks.md),
or GGUF blocks kept quantized in panels (`kernels/native/quantized*.c`)."""

from __future__ import annotations

import torch

from turnstile.kernels import cpu_native
from turnstile.kernels.quantized_weights import PackedWeight


class PackedProjection:
    """A projection on the native kernel, in float32 arithmetic whether the weight is float32
    or bfloat16 (widened in registers: half the bytes a token reads)."""

    __slots__ = ("bias", "out_features", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.packed = cpu_native.pack_weight(weight)  # the panels are all a forward needs
        self.bias = None if bias is None else bias.float()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The residual is added as each output is stored: no separate pass over memory."""
        return cpu_native.linear(x, self.packed, self.out_features, self.bias, residual)

    def native_weight(self) -> cpu_native.NativeWeight:
        """The panels as the fused decode layers take them."""
        bits = 8 * self.packed.element_size()
        return cpu_native.NativeWeight(self.packed.data_ptr(), bits)


class QuantizedProjection:
    """A projection on a weight's GGUF blocks, the activations quantized to int8 per block."""

    __slots__ = ("bias", "out_features", "weight")

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.weight = weight  # shared with the embedding where the head is tied
        self.bias = None if bias is None else bias.float()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight
        return cpu_native.linear_quantized(
            x, w.panels, self.out_features, w.bits, self.bias, residual
        )

    def native_weight(self) -> cpu_native.NativeWeight:
        return cpu_native.NativeWeight(self.weight.panels.data_ptr(), self.weight.bits)


NativeProjection = PackedProjection | QuantizedProjection
