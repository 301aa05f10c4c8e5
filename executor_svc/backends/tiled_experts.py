"""The cpu backend's mixture of experts on AMX-BF16 tiles (`kernels/native/expert_tiles.c`): the
router (its logits the backend's projection), then every expert's rows, their activation and
the weighted sum in one native call. For bfloat16 experts on a CPU with AMX-BF16; elsewhere the
torch experts' grouped matmuls (`model/experts.py`). Figures: docs/benchmarks.md."""

from __future__ import annotations

import torch

from turnstile.executor_svc.model.experts import ExpertWeights
from turnstile.executor_svc.model.routers import Router
from turnstile.kernels import cpu_native, expert_tiles
from turnstile.kernels.expert_calls import GLUS


class TiledExperts:
    __slots__ = ("_biases", "down", "gate_up", "native", "router")

    @staticmethod
    def takes(weights: ExpertWeights) -> bool:
        """Whether these experts run on the tiles here: bf16 weights, whole tiles, a gated
        activation the kernel has, a CPU with AMX-BF16."""
        _, hidden, inner = weights.down.shape
        return (
            weights.gate_up.dtype == torch.bfloat16
            and weights.gate_up.device.type == "cpu"
            and weights.glu.kind in GLUS
            and expert_tiles.fits(hidden, inner)
            and cpu_native.amx_tiles()
        )

    def __init__(self, router: Router, weights: ExpertWeights) -> None:
        self.router = router
        self.gate_up = expert_tiles.pack_gate_up(weights.gate_up)
        self.down = expert_tiles.pack_down(weights.down)
        self._biases = [
            None if bias is None else bias.float().contiguous()
            for bias in (weights.gate_up_bias, weights.down_bias)
        ]
        experts, hidden, inner = weights.down.shape
        glu = weights.glu
        self.native = expert_tiles.ExpertTilesWeights(
            self.gate_up.data_ptr(),
            self.down.data_ptr(),
            *(None if bias is None else bias.data_ptr() for bias in self._biases),
            experts,
            hidden,
            inner,
            GLUS.index(glu.kind),
            glu.alpha,
            glu.limit,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for each row of `x` [tokens, hidden], in x's dtype."""
        weights, chosen = self.router(x)
        return expert_tiles.run(self.native, x, chosen, weights).to(x.dtype)
