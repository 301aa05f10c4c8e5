"""bf16 experts on AMX-BF16 tiles (`kernels/native/expert_tiles.c`, the cpu backend's
`TiledExperts`): each token gets what its own experts give, computed one by one in float64 on
the same bf16 values; a token's bits do not depend on the tokens beside it; and a served
gpt-oss in bfloat16 takes them. The torch experts' grouped matmuls: `test_experts.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from turnstile.executor_svc.backends.tiled_experts import TiledExperts
from turnstile.executor_svc.model.experts import ExpertWeights, Glu, clamped_swiglu
from turnstile.executor_svc.model.projection import DenseProjection
from turnstile.executor_svc.model.routers import SoftmaxRouter
from turnstile.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.amx_tiles(), reason="this CPU has no AMX-BF16")


def _weights(experts: int, hidden: int, inner: int, glu: Glu, biases: bool) -> ExpertWeights:
    torch.manual_seed(0)
    gate_up = torch.randn(experts, 2 * inner, hidden) / hidden**0.5
    down = torch.randn(experts, hidden, inner) / inner**0.5
    bias = (torch.randn(experts, 2 * inner), torch.randn(experts, hidden)) if biases else ()
    return ExpertWeights(gate_up.bfloat16(), down.bfloat16(), glu, *(b.bfloat16() for b in bias))


def _one_by_one(w: ExpertWeights, x: torch.Tensor, weights: torch.Tensor,
                chosen: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Each token through each of its experts in turn, in float64 on the kernel's bf16 values:
    the input and the activation rounded to bf16 as the tiles take them."""
    glu = w.glu
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, row in enumerate(x.bfloat16().double()):
        for weight, e in zip(weights[t].double(), chosen[t], strict=True):
            gate_up = w.gate_up[e].double() @ row
            if w.gate_up_bias is not None:
                gate_up = gate_up + w.gate_up_bias[e].double()
            gate, up = gate_up.chunk(2)
            if glu.kind == "silu":
                act = F.silu(gate) * up
            else:
                act = clamped_swiglu(gate, up, glu.alpha, glu.limit)
            product = w.down[e].double() @ act.bfloat16().double()
            if w.down_bias is not None:
                product = product + w.down_bias[e].double()
            out[t] += weight * product
    return out


CASES = {  # experts, hidden, inner, top-k, tokens; the activation, biases
    "one token": (8, 64, 32, 2, 1, Glu("silu"), False),
    "most experts idle": (16, 96, 64, 4, 3, Glu("clamped_swiglu", 1.702, 2.0), True),
    "two row tiles, padding": (8, 64, 96, 3, 40, Glu("clamped_swiglu", 1.702, 2.0), True),
    "groups of 256 rows": (4, 128, 64, 2, 600, Glu("silu"), True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_each_token_gets_its_own_experts_weighted_sum(case: tuple) -> None:
    experts, hidden, inner, top_k, tokens, glu, biases = case
    w = _weights(experts, hidden, inner, glu, biases)
    router = SoftmaxRouter(DenseProjection(torch.randn(experts, hidden)), top_k, normalize=True)
    x = torch.randn(tokens, hidden)
    tiled = TiledExperts(router, w)
    weights, chosen = router(x)
    expected = _one_by_one(w, x, weights, chosen)
    if tokens > 100:  # every expert's rows span more than one group
        assert torch.bincount(chosen.flatten()).min() > 256
    # The activation's bf16 rounding may differ by its last bit from float64's.
    torch.testing.assert_close(tiled(x).double(), expected, atol=2e-3, rtol=1e-3)


def test_a_tokens_bits_do_not_depend_on_the_tokens_beside_it() -> None:
    """Given its experts and weights (the router's own: `test_experts`)."""
    from turnstile.kernels import expert_tiles

    w = _weights(8, 64, 96, Glu("clamped_swiglu", 1.702, 2.0), biases=True)
    router = SoftmaxRouter(DenseProjection(torch.randn(8, 64)), 2, normalize=True)
    tiled = TiledExperts(router, w)
    x = torch.randn(50, 64)
    weights, chosen = router(x)
    together = expert_tiles.run(tiled.native, x, chosen, weights)
    for t in (0, 17, 49):
        one = slice(t, t + 1)
        alone = expert_tiles.run(tiled.native, x[one], chosen[one], weights[one])
        assert torch.equal(alone[0], together[t])


def test_an_expert_out_of_range_is_refused() -> None:
    from turnstile.kernels import expert_tiles

    tiled = TiledExperts(SoftmaxRouter(DenseProjection(torch.randn(4, 64)), 2, True),
                         _weights(4, 64, 32, Glu("silu"), biases=False))  # fmt: skip
    chosen = torch.tensor([[0, 4]])
    with pytest.raises(ValueError, match="out of range 0-3"):
        expert_tiles.run(tiled.native, torch.randn(1, 64), chosen, torch.ones(1, 2))


def test_only_bf16_experts_of_whole_tiles_take_the_tiles() -> None:
    assert TiledExperts.takes(_weights(4, 64, 32, Glu("silu"), False))
    assert not TiledExperts.takes(_weights(4, 64, 48, Glu("silu"), False))  # 48 inner
    assert not TiledExperts.takes(_weights(4, 64, 32, Glu("gelu_tanh"), False))
    as_float = _weights(4, 64, 32, Glu("silu"), False)
    assert not TiledExperts.takes(ExpertWeights(as_float.gate_up.float(), as_float.down.float(),
                                                as_float.glu))  # fmt: skip


def test_the_cpu_backend_takes_the_tiles_unless_told_rows() -> None:
    from turnstile.executor_svc.backends import create_backend
    from turnstile.executor_svc.model.experts import Experts
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.shared.model_info import embedded_model_path, read_model_info
    from turnstile.shared.settings import build

    info = read_model_info(embedded_model_path())
    weights = _weights(4, 64, 32, Glu("silu"), biases=False)
    router = SoftmaxRouter(DenseProjection(torch.randn(4, 64)), 2, True)
    tiles = create_backend(build(RunnerConfig), info)
    assert isinstance(tiles.experts(router, weights), TiledExperts)
    rows = create_backend(build(RunnerConfig, cpu_bf16_products="rows"), info)
    assert isinstance(rows.experts(router, weights), Experts)


@pytest.mark.slow  # loads transformers
def test_a_bf16_gpt_oss_on_the_cpu_backend_runs_its_experts_on_the_tiles(tmp_path: Path) -> None:
    """The first token after each prompt and its top logprobs, against transformers in float32:
    the same tokens, and logprobs within twice the distance of the torch backend's in bf16."""
    from conftest import fixed_length_requests
    from test_gpt_oss import _gpt_oss
    from test_model_families import PROMPTS, _hf_generate

    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.offline import OfflineEngine
    from turnstile.shared.config import SchedulingConfig
    from turnstile.shared.protocol import SamplingParams
    from turnstile.shared.settings import build

    expected, theirs = _hf_generate(_gpt_oss(tmp_path))
    distance = {}
    for backend in ("cpu", "torch"):
        config = build(RunnerConfig, model=str(tmp_path), dtype="bfloat16", backend=backend,
                       num_blocks=64, max_num_seqs=4)  # fmt: skip
        engine = OfflineEngine(config, SchedulingConfig(max_num_batched_tokens=256))
        tiled = [isinstance(layer.experts, TiledExperts) for layer in engine.runner.model.layers]
        assert all(tiled) if backend == "cpu" else not any(tiled)
        results = engine.generate(fixed_length_requests(PROMPTS, SamplingParams(logprobs=5), 1))
        assert [r.token_ids[0] for r in results] == [tokens[0] for tokens in expected]
        distance[backend] = max(
            (torch.tensor([logprob for _, logprob in result.logprobs[0]])
             - logits[0][[token for token, _ in result.logprobs[0]]]).abs().max().item()
            for result, logits in zip(results, theirs, strict=True)
        )  # fmt: skip
    assert distance["cpu"] <= 2 * distance["torch"], distance


@pytest.mark.slow  # loads transformers
def test_a_bf16_gpt_oss_generates_alike_alone_and_batched(tmp_path: Path) -> None:
    """Its router (the native projection, whose row's bits alone: `test_experts`), experts (the
    tiles) and prompts' attention (rows on the tiles) give a token the same bits in any batch:
    tokens and logprobs alike."""
    from conftest import fixed_length_requests
    from test_gpt_oss import _gpt_oss
    from test_model_families import PROMPTS

    from turnstile.executor_svc.backends.packed_projection import PackedProjection
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.offline import OfflineEngine
    from turnstile.shared.config import SchedulingConfig
    from turnstile.shared.protocol import SamplingParams
    from turnstile.shared.settings import build

    _gpt_oss(tmp_path)
    config = build(RunnerConfig, model=str(tmp_path), dtype="bfloat16", num_blocks=64,
                   max_num_seqs=4)  # fmt: skip
    engine = OfflineEngine(config, SchedulingConfig(max_num_batched_tokens=256))
    layers = engine.runner.model.layers
    assert all(isinstance(layer.experts.router.logits, PackedProjection) for layer in layers)

    def generate(prompts: list[list[int]]) -> list[tuple]:
        requests = fixed_length_requests(prompts, SamplingParams(logprobs=5), 12)
        return [(r.token_ids, r.logprobs) for r in engine.generate(requests)]

    together = generate(PROMPTS)
    assert [generate([prompt])[0] for prompt in PROMPTS] == together
