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
from turnstile.kernels.mxfp4_weights import mxfp4_blocks
from turnstile.kernels.quantized_weights import QuantizedWeight


def measure(
    tokens: list[int], experts: int, hidden: int, inner: int, top_k: int, repeats: int,
    blocks: str = "",
) -> dict[int, dict[str, float]]:  # fmt: skip
    """Per token count: ms for each path (median of `repeats`), and how far each other path's
    outputs are from the grouped matmuls' ("PATH apart": the largest difference over the
    largest magnitude). `blocks`: "q4_k_m" or "mxfp4" adds the experts in those blocks
    (MXFP4's: random blocks, and the bf16 paths on their very values)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).bfloat16()

    glu = Glu("clamped_swiglu", 1.702, 7.0)
    biases = (randn(experts, 2 * inner), randn(experts, hidden))
    in_blocks = None
    if blocks == "mxfp4":  # the bf16 paths on the blocks' very values
        in_blocks = BlockExpertWeights(*_mxfp4(experts, hidden, inner, generator), glu, *biases)
        weights = in_blocks.dense(torch.bfloat16)
    else:
        gate_up = randn(experts, 2 * inner, hidden, scale=hidden**-0.5)
        weights = ExpertWeights(gate_up, randn(experts, hidden, inner, scale=inner**-0.5), glu,
                                *biases)  # fmt: skip
    router = SoftmaxRouter(
        DenseProjection(torch.randn(experts, hidden, generator=generator)), top_k, True
    )
    paths = {"grouped_mm": Experts(router, weights)}
    if TiledExperts.takes(weights):
        paths["tiles"] = TiledExperts(router, weights)
    if blocks:
        paths["blocks"] = BlockExperts(router, in_blocks or _in_blocks(weights))
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


def _mxfp4(experts: int, hidden: int, inner: int, generator: torch.Generator) -> tuple:
    """Random MXFP4 gate, up and down of each expert, scales about a trained model's."""

    def matrix(rows: int, inputs: int) -> QuantizedWeight:
        codes = torch.randint(
            0, 256, (rows, inputs // 32, 16), dtype=torch.uint8, generator=generator
        )
        scales = torch.randint(
            118, 122, (rows, inputs // 32), dtype=torch.uint8, generator=generator
        )
        kept = mxfp4_blocks(codes, scales)
        assert kept is not None
        return kept

    return tuple(tuple(matrix(*shape) for _ in range(experts))
                 for shape in ((inner, hidden), (inner, hidden), (hidden, inner)))  # fmt: skip
