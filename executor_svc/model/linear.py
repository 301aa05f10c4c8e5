"""A projection `x @ weight.T (+ bias) (+ residual)`, multiplied the fastest way the device has.

On a CPU with AVX2 and FMA the weight is stored once in panels and multiplied by the native
kernel (`kernels/native/gemm.c`), in float32 arithmetic whether the weight is float32 or
bfloat16. Against oneDNN with prepacked weights (the previous path), in an ad-hoc timing here
of the model's 120 layer matrices (float32, weights cold, median of 7): 1 row 15.3 against 24.9
ms, 16 rows 31.8 against 42.7, 64 rows 102 against 124, 1,024 rows 1.55 against 1.78 s; with
bfloat16 weights 1 row takes 8.7 ms. Elsewhere (CUDA, or a CPU the kernel cannot run on) it is
a plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_native


class Linear:
    __slots__ = ("bias", "out_features", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """`weight` is [out, in], as checkpoints store it."""
        self.out_features = weight.shape[0]
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        if cpu_native.multiplies(weight.device, weight.dtype):
            self.packed = cpu_native.pack_weight(weight)
            self.weight = None  # the panels are all a CPU forward needs
            self.bias = None if bias is None else bias.float()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ weight.T + bias`, plus `residual` when given (added as each output is stored
        on the CPU, so the sum never makes a separate pass over memory)."""
        if self.packed is not None:
            return cpu_native.linear(x, self.packed, self.out_features, self.bias, residual)
        out = F.linear(x, self.weight, self.bias)  # type: ignore[arg-type]
        return out if residual is None else residual + out
