"""Projections on the native CPU kernel (`kernels/native/gemm.c`): the weight stored once in
panels of 16 output features. Against oneDNN with prepacked weights: docs/benchmarks.md."""

from __future__ import annotations

import torch

from turnstile.kernels import cpu_native


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
