"""The cpu backend's mixture of experts on weights kept in their GGUF blocks
(`kernels/native/quantized_experts.c`): the router (its logits the backend's projection), then
every expert's rows, their activation and the weighted sum in one native call, the products
int8 dot products as a quantized projection's. A MoE GGUF file's experts, most of its bytes,
stay at 5 to 9 bits a weight (the codes, and a float16 scale and offset each 32) instead of
float32's 32; gpt-oss's MXFP4 ones at 5. Figures: docs/benchmarks.md."""

from __future__ import annotations

import torch

from turnstile.executor_svc.model.experts import BlockExpertWeights
from turnstile.executor_svc.model.routers import Router
from turnstile.kernels import quantized_experts
from turnstile.kernels.expert_calls import GLUS


class BlockExperts:
    __slots__ = ("packed", "router")

    @staticmethod
    def takes(weights: BlockExpertWeights) -> bool:
        """Whether the kernel has these experts' gated activation and makes whole blocks of
        their sizes."""
        inner, hidden = weights.gate[0].shape
        return weights.glu.kind in GLUS and quantized_experts.fits(hidden, inner)

    def __init__(self, router: Router, weights: BlockExpertWeights) -> None:
        self.router = router
        glu = weights.glu
        self.packed = quantized_experts.PackedExperts(
            (weights.gate, weights.up, weights.down), (weights.gate_up_bias, weights.down_bias),
            glu.kind, glu.alpha, glu.limit,
        )  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for each row of `x` [tokens, hidden], in x's dtype."""
        weights, chosen = self.router(x)
        return self.packed(x, chosen, weights).to(x.dtype)
