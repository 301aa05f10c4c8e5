"""A mixture of experts' bfloat16 weights as the AMX-BF16 tiles take them
(`kernels/native/expert_tiles.c`), and the call: every expert's rows in one native call."""

from __future__ import annotations

import ctypes

import torch

from turnstile.kernels import cpu_native
from turnstile.kernels.expert_calls import EXPERT_FIELDS, call_experts

PANEL, CHUNK = 16, 32  # output features a B tile; inputs a B tile (16 pairs)
PROFILE_LABEL = "native::experts"  # what a profile finds the call by
_PTR = ctypes.c_void_p


class ExpertTilesWeights(ctypes.Structure):
    """expert_tiles.c's `Experts`."""

    _fields_ = [("gate_up", _PTR), ("down", _PTR), *EXPERT_FIELDS]


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
    return call_experts(lib.expert_tiles, weights, x, chosen, routed, PROFILE_LABEL)
