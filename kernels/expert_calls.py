"""What the native mixtures of experts share (`expert_tiles.py` on AMX-BF16 tiles,
`quantized_experts.py` on GGUF blocks; `kernels/native/experts.h`): the fields after each
kernel's weights in its struct, the gated activations' numbers, and the call."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_PTR, _LONG, _FLOAT = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
GLUS = ("silu", "clamped_swiglu")  # experts.h's numbers for the gated activations
EXPERT_FIELDS = [
    *((name, _PTR) for name in ("gate_up_bias", "down_bias")),
    *((name, _LONG) for name in ("experts", "hidden", "inner", "glu")),
    ("alpha", _FLOAT),
    ("limit", _FLOAT),
]


def call_experts(
    function: Any, weights: ctypes.Structure, x: torch.Tensor, chosen: torch.Tensor,
    routed: torch.Tensor, label: str, *more: int,
) -> torch.Tensor:  # fmt: skip
    """Each row of `x` [tokens, hidden] through its `chosen` experts [tokens, top_k], weighted
    by `routed` [tokens, top_k], summed: float32 [tokens, hidden]; `function` the kernel,
    `label` what a profile finds it by, `more` its arguments after the output."""
    x, chosen = x.float().contiguous(), chosen.to(torch.int64).contiguous()
    routed = routed.float().contiguous()
    out = x.new_empty(x.shape)
    tokens, top_k = chosen.shape
    with torch.profiler.record_function(label):
        failed = function(
            ctypes.addressof(weights), x.data_ptr(), tokens, top_k, chosen.data_ptr(),
            routed.data_ptr(), out.data_ptr(), *more,
        )  # fmt: skip
    if failed == -2:
        raise ValueError(f"a chosen expert is out of range 0-{weights.experts - 1}")
    if failed:
        raise MemoryError(f"{label} could not allocate its buffers")
    return out
