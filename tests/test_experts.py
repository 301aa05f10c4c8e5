"""The mixture-of-experts MLP (`executor_svc/model/experts.py`): its grouped matmuls give each
token what its own top-k experts give, one by one; and the grouping needs no value on the host,
so a CUDA step stays on the device (meta tensors stand in for the GPU, as in
`test_device_discipline.py`). Whole Mixtral and Qwen3-MoE models against transformers:
`test_model_families.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turnstile.executor_svc.model.experts import Experts, ExpertWeights, Glu
from turnstile.executor_svc.model.projection import DenseProjection
from turnstile.executor_svc.model.routers import SoftmaxRouter

EXPERTS, HIDDEN, INNER = 8, 64, 32


def _experts(device: str, dtype: torch.dtype, normalize: bool) -> Experts:
    torch.manual_seed(0)
    shapes = ((EXPERTS, HIDDEN), (EXPERTS, 2 * INNER, HIDDEN), (EXPERTS, HIDDEN, INNER))
    router, gate_up, down = (torch.randn(s).to(device=device, dtype=dtype) for s in shapes)
    router = SoftmaxRouter(DenseProjection(router), top_k=3, normalize=normalize)
    return Experts(router, ExpertWeights(gate_up, down, Glu("silu")))


def _one_by_one(experts: Experts, x: torch.Tensor) -> torch.Tensor:
    """Each token through each of its top-k experts in turn, in float64."""
    router, gate_up = (
        experts.router.logits.weight.double(),
        experts.gate_up.transpose(1, 2).double(),
    )
    down = experts.down.transpose(1, 2).double()
    out = torch.zeros_like(x, dtype=torch.float64)
    for t, row in enumerate(x.double()):
        probs = (router @ row).softmax(-1)
        weights, chosen = probs.topk(experts.router.top_k)
        if experts.router.normalize:
            weights = weights / weights.sum()
        for weight, e in zip(weights, chosen, strict=True):
            gate, up = (gate_up[e] @ row).chunk(2)
            out[t] += weight * (down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 40])  # 1 and 5: most experts get no token
def test_grouped_experts_give_each_token_its_own_experts_sum(tokens: int, normalize: bool) -> None:
    experts = _experts("cpu", torch.float32, normalize)
    x = torch.randn(tokens, HIDDEN)
    expected = _one_by_one(experts, x)
    torch.testing.assert_close(experts(x).double(), expected, atol=1e-3, rtol=1e-4)


def test_the_experts_run_on_the_device_without_a_host_sync() -> None:
    experts = _experts("meta", torch.bfloat16, normalize=True)
    out = experts(torch.empty(7, HIDDEN, device="meta", dtype=torch.bfloat16))
    assert out.device.type == "meta" and out.shape == (7, HIDDEN)


@pytest.mark.parametrize("bias", [False, True])
def test_the_cpu_backends_router_picks_a_tokens_experts_with_the_same_bits_alone(
    bias: bool,
) -> None:
    """Its logits are the backend's native projection, whose rows do not depend on the rows
    beside them (torch's `F.linear`'s do), so a token's experts and their weights are the same
    bits alone as in any batch: a request generates alike crowded or alone."""
    from turnstile.executor_svc.backends import create_backend
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.shared.model_info import embedded_model_path, read_model_info
    from turnstile.shared.settings import build

    backend = create_backend(build(RunnerConfig), read_model_info(embedded_model_path()))
    generator = torch.Generator().manual_seed(2)
    weight, b, x = (torch.randn(*shape, generator=generator)
                    for shape in ((32, 512), (32,), (200, 512)))  # fmt: skip
    router = SoftmaxRouter(backend.projection(weight, b if bias else None), 4, normalize=True)
    weights, chosen = router(x)
    for t in (0, 1, 77, 199):
        alone = router(x[t : t + 1])
        assert torch.equal(alone[0][0], weights[t]) and torch.equal(alone[1][0], chosen[t])
