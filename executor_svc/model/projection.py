"""A projection `x @ weight.T (+ bias) (+ residual)`: each backend makes its own (the CPU's
packs the weight for its native kernel); this is the plain one, cuBLAS on CUDA."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F


class Projection(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ weight.T + bias`, plus `residual` when given."""
        ...


# A backend's projection from a weight, dense or `QuantizedWeight`, and a bias.
ProjectionFactory = Callable[[Any, "torch.Tensor | None"], Projection]


class DenseProjection:
    __slots__ = ("bias", "out_features", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """`weight` is [out, in], as checkpoints store it."""
        self.out_features = weight.shape[0]
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out if residual is None else residual + out
