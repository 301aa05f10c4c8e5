"""`turnstile bench experts`: one layer of bf16 experts, as gpt-oss has them (biases, the clamped
SwiGLU) by default, on `tokens` rows: torch's grouped matmuls (`model/experts.py`) against the
cpu backend's AMX-BF16 tiles (`backends/tiled_experts.py`) and, with `blocks`, the same values
in Q4_K_M's blocks (gate and up Q4_K, down Q6_K; `backends/block_experts.py`), the same router
before each. Random weights (the time does not depend on them)."""

from __future__ import annotations

import torch

from turnstile.bench.requantize import Q, quantize
from turnstile.bench.timing import median_ms
from turnstile.executor_svc.backends.block_experts import BlockExperts
from turnstile.executor_svc.backends.tiled_experts import TiledExperts
from turnstile.executor_svc.model.experts import BlockExpertWeights, Experts, ExpertWeights, Glu
from turnstile.executor_svc.model.projection import DenseProjection
from turnstile.executor_svc.model.routers import SoftmaxRouter
from turnstile.kernels.gguf_blocks import from_gguf


def measure(
    tokens: list[int], experts: int, hidden: int, inner: int, top_k: int, repeats: int,
    blocks: bool = False,
) -> dict[int, dict[str, float]]:  # fmt: skip
    """Per token count: ms for each path (median of `repeats`), and how far each other path's
    outputs are from the grouped matmuls' ("PATH apart": the largest difference over the
    largest magnitude)."""
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
    if blocks:
        paths["blocks"] = BlockExperts(router, _in_blocks(weights))
    report: dict[int, dict[str, float]] = {}
    for count in tokens:
        x = torch.randn(count, hidden, generator=generator)
        report[count] = {
            name: median_ms(lambda p=path, x=x: p(x), repeats) for name, path in paths.items()
        }
        grouped = paths["grouped_mm"](x)
        for name, path in list(paths.items())[1:]:
            apart = (grouped - path(x)).abs().max() / grouped.abs().max()
            report[count][f"{name} apart"] = float(apart)
    return report


def _in_blocks(weights: ExpertWeights) -> BlockExpertWeights:
    """Q4_K_M's formats: gate and up in Q4_K, down in Q6_K."""

    def matrices(stacked: torch.Tensor, kind: Q) -> tuple:
        return tuple(from_gguf(quantize(m.float().numpy(), kind), kind) for m in stacked)

    gate, up = weights.gate_up.chunk(2, dim=1)
    return BlockExpertWeights(
        matrices(gate, Q.Q4_K), matrices(up, Q.Q4_K), matrices(weights.down, Q.Q6_K),
        weights.glu, weights.gate_up_bias, weights.down_bias,
    )  # fmt: skip
