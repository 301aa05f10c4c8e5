"""A mixture of experts' bfloat16 weights as the AMX-BF16 tiles take them
(`kernels/native/expert_tiles.c`), and the call: every expert's rows in one native call."""

from __future__ import annotations

import ctypes

import torch

from turnstile.kernels import cpu_native

PANEL, CHUNK = 16, 32  # output features a B tile; inputs a B tile (16 pairs)
GLUS = ("silu", "clamped_swiglu")  # expert_tiles.c's numbers for the gated activations
PROFILE_LABEL = "native::experts"  # what a profile finds the call by
_PTR, _LONG, _FLOAT = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class ExpertTilesWeights(ctypes.Structure):
    """expert_tiles.c's `Experts`."""

    _fields_ = [
        *((name, _PTR) for name in ("gate_up", "down", "gate_up_bias", "down_bias")),
        *((name, _LONG) for name in ("experts", "hidden", "inner", "glu")),
        ("alpha", _FLOAT),
        ("limit", _FLOAT),
    ]


def fits(hidden: int, inner: int) -> bool:
    """Whether experts of these sizes (this rank's `inner`) make whole tiles."""
    return hidden % CHUNK == 0 and inner % CHUNK == 0


def pack_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """[experts, 2 * inner, hidden] bf16 (each expert's gate rows, then its up rows) as
    [experts, inner / 16, hidden / 32, gate then up, tile]: each matrix in gemm.c's bf16 panels
    (`pack_weight`, the tiles' B layout), a panel's gate and up tiles of a chunk side by side,
    read in one stream."""
    experts, rows, hidden = gate_up.shape
    inner = rows // 2

    def tiles(weight: torch.Tensor) -> torch.Tensor:
        return cpu_native.pack_weight(weight).view(inner // PANEL, hidden // CHUNK, -1)

    pairs = gate_up.view(experts, 2, inner, hidden)
    return torch.stack([torch.stack((tiles(gate), tiles(up)), dim=2) for gate, up in pairs])


def pack_down(down: torch.Tensor) -> torch.Tensor:
    """[experts, hidden, inner] bf16 as each expert's panels: [experts, hidden / 16, inner / 32,
    tile]."""
    return torch.stack([cpu_native.pack_weight(weight) for weight in down])


def run(
    weights: ExpertTilesWeights, x: torch.Tensor, chosen: torch.Tensor, routed: torch.Tensor
) -> torch.Tensor:
    """Each row of `x` [tokens, hidden] (float32) through its `chosen` experts [tokens, top_k],
    weighted by `routed` [tokens, top_k], summed: float32 [tokens, hidden]."""
    lib = cpu_native.library()
    assert lib is not None
    x, chosen = x.float().contiguous(), chosen.to(torch.int64).contiguous()
    routed = routed.float().contiguous()
    out = x.new_empty(x.shape)
    tokens, top_k = chosen.shape
    with torch.profiler.record_function(PROFILE_LABEL):
        failed = lib.expert_tiles(
            ctypes.addressof(weights), x.data_ptr(), tokens, top_k, chosen.data_ptr(),
            routed.data_ptr(), out.data_ptr(),
        )  # fmt: skip
    if failed == -2:
        raise ValueError(f"a chosen expert is out of range 0-{weights.experts - 1}")
    if failed:
        raise MemoryError("the experts' tiles could not allocate their buffers")
    return out
