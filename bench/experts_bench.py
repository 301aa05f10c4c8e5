"""`turnstile bench experts`: one layer of bf16 experts, as gpt-oss has them (biases, the clamped
SwiGLU) by default, on `tokens` rows: torch's grouped matmuls (`model/experts.py`) against the
cpu backend's AMX-BF16 tiles (`backends/tiled_experts.py`), the same router before each. Random
weights (the time does not depend on them)."""

from __future__ import annotations

import torch

from turnstile.bench.timing import median_ms
from turnstile.executor_svc.backends.tiled_experts import TiledExperts
from turnstile.executor_svc.model.experts import Experts, ExpertWeights, Glu
from turnstile.executor_svc.model.projection import DenseProjection
from turnstile.executor_svc.model.routers import SoftmaxRouter


def measure(
    tokens: list[int], experts: int, hidden: int, inner: int, top_k: int, repeats: int
) -> dict[int, dict[str, float]]:
    """Per token count: ms for each path (median of `repeats`), and how far apart their outputs
    are ("apart": the largest difference over the largest magnitude)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).bfloat16()

    weights = ExpertWeights(
        randn(experts, 2 * inner, hidden, scale=hidden**-0.5),
        randn(experts, hidden, inner, scale=inner**-0.5),
        Glu("clamped_swiglu", 1.702, 7.0),
        randn(experts, 2 * inner),
        randn(experts, hidden),
    )
    router = SoftmaxRouter(
        DenseProjection(torch.randn(experts, hidden, generator=generator)), top_k, True
    )
    paths = {"grouped_mm": Experts(router, weights)}
    if TiledExperts.takes(weights):
        paths["tiles"] = TiledExperts(router, weights)
    report: dict[int, dict[str, float]] = {}
    for count in tokens:
        x = torch.randn(count, hidden, generator=generator)
        report[count] = {
            name: median_ms(lambda p=path, x=x: p(x), repeats) for name, path in paths.items()
        }
        if "tiles" in paths:
            grouped, tiled = (path(x) for path in paths.values())
            report[count]["apart"] = float((grouped - tiled).abs().max() / grouped.abs().max())
    return report
