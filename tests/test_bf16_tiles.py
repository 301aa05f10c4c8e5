"""bf16 weights' products on AMX-BF16 tiles (`kernels/native/bf16_tiles.c`,
`--cpu-bf16-products`): each row rounded to bf16, sums in fp32, the bias and residual added; a
row's bits whatever its batch; and a bf16 model on them takes one route for every token, so a
prompt's tokens are the same run alone or crowded (preempted, recomputed). Their float32
arithmetic on the same panels: `test_native_kernels.py`, `test_fused_decode_layers.py`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from turnstile.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.amx_tiles(), reason="this CPU has no AMX-BF16")


@pytest.mark.parametrize(("rows", "out", "inputs"), [(1, 40, 64), (17, 33, 96), (300, 100, 576)])
def test_the_product_is_the_bf16_rows_product_summed_in_float32(
    rows: int, out: int, inputs: int
) -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(out, inputs).bfloat16(), torch.randn(rows, inputs)
    bias, residual = torch.randn(out), torch.randn(rows, out)
    packed = cpu_native.pack_weight(weight)
    ours = cpu_native.linear(x, packed, out, bias, residual, tiles=True)
    expected = x.bfloat16().double() @ weight.double().T + bias.double() + residual.double()
    torch.testing.assert_close(ours.double(), expected, atol=1e-5 * inputs**0.5, rtol=1e-6)
    plain = cpu_native.linear(x, packed, out, tiles=True)
    torch.testing.assert_close(plain.double(), expected - bias.double() - residual.double(),
                               atol=1e-5 * inputs**0.5, rtol=1e-6)  # fmt: skip


def test_a_rows_bits_do_not_depend_on_its_batch() -> None:
    """1,103 rows: several blocks of rows, a last partial tile."""
    torch.manual_seed(1)
    weight = cpu_native.pack_weight(torch.randn(72, 256).bfloat16())
    x = torch.randn(1103, 256)
    together = cpu_native.linear(x, weight, 72, tiles=True)
    for row in (0, 31, 700, 1102):
        assert torch.equal(cpu_native.linear(x[row : row + 1], weight, 72, tiles=True)[0],
                           together[row])  # fmt: skip


def test_a_gated_product_is_the_whole_product_then_its_silu() -> None:
    """gated_bf16_tiles (the fused layers' gate-up, SiLU as the sums leave the tiles): the bits
    of the whole product, then silu_and_multiply."""
    lib = cpu_native.library()
    assert lib is not None
    torch.manual_seed(3)
    for rows, n, inputs in ((1, 48, 64), (37, 96, 128), (300, 160, 576)):
        weight, x = (
            cpu_native.pack_weight(torch.randn(2 * n, inputs).bfloat16()),
            torch.randn(rows, inputs),
        )
        gate_up = cpu_native.linear(x, weight, 2 * n, tiles=True)
        expected, got = torch.empty(rows, n), torch.empty(rows, n)
        lib.silu_and_multiply(gate_up.data_ptr(), expected.data_ptr(), rows, n)
        failed = lib.gated_bf16_tiles(x.data_ptr(), weight.data_ptr(), got.data_ptr(), rows, n,
                                      inputs)  # fmt: skip
        assert failed == 0 and torch.equal(got, expected)


def test_the_fused_layers_multiply_on_the_same_tiles() -> None:
    """decode_layer.c's product of a tiled projection's weight: the same bits as its call."""
    from turnstile.executor_svc.backends.packed_projection import PackedProjection

    torch.manual_seed(2)
    bias, x = torch.randn(48), torch.randn(21, 64)
    projection = PackedProjection(torch.randn(48, 64).bfloat16(), bias, tiles=True)
    fused = cpu_native.linear_weight(x, projection.native_weight(), 48, projection.bias)
    assert torch.equal(fused, projection(x))


@pytest.mark.slow
def test_a_bf16_model_on_the_tiles_generates_alike_on_every_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The embedded model in bfloat16: prompts run together in 32-token chunks with too few KV
    blocks (preempted, recomputed) give each prompt's tokens alone; every token a row of the
    fused layers, on a bfloat16 KV cache, even where prefill chunks would take the model's
    layers (no chunk counted short here)."""
    from conftest import fixed_length_requests

    from turnstile.bench.parity_bench import prompt_ids
    from turnstile.executor_svc import step_layout
    from turnstile.executor_svc.backends.packed_projection import PackedProjection
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.offline import OfflineEngine
    from turnstile.shared.config import SchedulingConfig
    from turnstile.shared.protocol import SamplingParams
    from turnstile.shared.settings import build

    monkeypatch.setattr(step_layout, "SHORT_PREFILL_TOKENS", 0)
    requests = fixed_length_requests(prompt_ids()[:4], SamplingParams(), 40)
    crowded = OfflineEngine(build(RunnerConfig, dtype="bfloat16", num_blocks=12, max_num_seqs=4),
                            SchedulingConfig(max_num_batched_tokens=32))  # fmt: skip
    runner = crowded.runner
    assert runner.kv_dtype == torch.bfloat16
    layer = runner.model.layers[0]
    assert all(isinstance(p, PackedProjection) and p.tiles for p in (layer.qkv, layer.down))
    routes, route = [], runner.backend.route

    def recorded(layout: Any) -> Any:
        routes.append(route(layout))
        return routes[-1]

    runner.backend.route = recorded  # type: ignore[method-assign]
    together = [r.token_ids for r in crowded.generate(requests)]
    assert {r.value for r in routes} == {"fused"}
    assert crowded.scheduler.stats.num_preemptions > 0
    assert crowded.scheduler.pool.num_free == 12
    alone = OfflineEngine(build(RunnerConfig, dtype="bfloat16", num_blocks=64))
    assert together == [alone.generate([r])[0].token_ids for r in requests]
