"""GGUF blocks kept quantized (#25): unpacked to exactly the file's values, multiplied by the
native kernels on every ISA this CPU has as the torch reference multiplies them, a row's result
the same in any batch; the embedded model served on them generates alike on every route, and
loses under 1% perplexity against float32."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from turnstile.kernels import cpu_native
from turnstile.kernels.quantized_weights import (
    Q,
    QuantizedWeight,
    from_gguf,
    pack,
    reference_linear,
)

KINDS = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
needs_native = pytest.mark.skipif(cpu_native.library() is None, reason="no native CPU kernels")


def _weight(kind: gguf.GGMLQuantizationType, rows: int, inputs: int) -> QuantizedWeight:
    values = np.random.default_rng(rows).normal(0, 0.05, (rows, inputs)).astype(np.float32)
    values[:, :32] += 0.2  # a block whose offset (Q4_1's m) is far from zero
    return from_gguf(gguf.quants.quantize(values, kind), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_blocks_unpack_to_the_files_values(kind: gguf.GGMLQuantizationType) -> None:
    values = np.random.default_rng(0).normal(0, 0.1, (7, 96)).astype(np.float32)
    data = gguf.quants.quantize(values, kind)
    expected = torch.from_numpy(gguf.quants.dequantize(data, kind).astype(np.float32))
    assert torch.equal(from_gguf(data, kind).dequantize(), expected)


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_the_quantized_product_is_the_reference_on_every_isa(
    kind: gguf.GGMLQuantizationType,
) -> None:
    weight = _weight(kind, 100, 576)  # 100 features: a last, partial panel
    packed = pack(weight).panels
    bias, generator = torch.randn(100), torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 5, 6, 7, 13):  # every tile shape, full tiles and rests
        x = torch.randn(rows, 576, generator=generator)
        residual = torch.randn(rows, 100, generator=generator)
        expected = reference_linear(x, weight) + bias + residual
        results = [
            cpu_native.linear_quantized(x, packed, 100, weight.bits, bias, residual, isa=isa)
            for isa in cpu_native.usable_isas()
        ]
        torch.testing.assert_close(results[0], expected, rtol=1e-5, atol=1e-5)
        for other in results[1:]:  # the same integer sums, the same float steps: the same bits
            assert torch.equal(other, results[0])


@needs_native
def test_a_row_of_the_quantized_product_does_not_depend_on_its_batch() -> None:
    """Recomputing a preempted sequence alone must give the bits it had in a batch."""
    weight = _weight(Q.Q4_1, 64, 256)
    packed, x = pack(weight).panels, torch.randn(13, 256)
    together = cpu_native.linear_quantized(x, packed, 64, 4)
    for row in (0, 5, 12):
        alone = cpu_native.linear_quantized(x[row : row + 1], packed, 64, 4)
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_rows_are_picked_and_stacked_as_dense_rows(
    kind: gguf.GGMLQuantizationType,
) -> None:
    """The model reorders q and k rows and stacks q, k, v: the same on blocks as on values."""
    a, b = _weight(kind, 8, 64), _weight(kind, 4, 64)
    order = torch.tensor([3, 0, 7, 1])
    assert torch.equal(a[order].dequantize(), a.dequantize()[order])
    stacked = QuantizedWeight.cat([a, b]).dequantize()
    assert torch.equal(stacked, torch.cat((a.dequantize(), b.dequantize())))
    packed = pack(QuantizedWeight.cat([a, b]))  # an embedding's rows, from its panels
    assert torch.equal(packed.rows(torch.tensor([11, 2, 11, 5])), stacked[[11, 2, 11, 5]])
    with pytest.raises(ValueError, match="one code width"):
        QuantizedWeight.cat([a, _weight(Q.Q8_0 if kind != Q.Q8_0 else Q.Q4_0, 4, 64)])


@pytest.mark.slow
@needs_native
def test_the_embedded_models_blocks_generate_alike_on_every_route() -> None:
    """Prompts run together in 32-token chunks with too few KV blocks (preempted, recomputed;
    the fused decode layers and the model's layers both run) give each prompt's tokens alone."""
    from conftest import fixed_length_requests

    from turnstile.bench.parity_bench import prompt_ids
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.offline import OfflineEngine
    from turnstile.shared.config import SchedulingConfig
    from turnstile.shared.protocol import SamplingParams
    from turnstile.shared.settings import build

    prompts = prompt_ids()[:4]
    requests = fixed_length_requests(prompts, SamplingParams(), 40)
    crowded = OfflineEngine(build(RunnerConfig, quantization="gguf", num_blocks=12, max_num_seqs=4),
                            SchedulingConfig(max_num_batched_tokens=32))  # fmt: skip
    assert crowded.runner.quantized
    together = [r.token_ids for r in crowded.generate(requests)]
    assert crowded.scheduler.stats.num_preemptions > 0
    assert crowded.scheduler.pool.num_free == 12
    alone = OfflineEngine(build(RunnerConfig, quantization="gguf", num_blocks=64))
    assert together == [alone.generate([r])[0].token_ids for r in requests]


@pytest.mark.slow
@needs_native
def test_the_gguf_blocks_lose_under_one_percent_perplexity_to_float32() -> None:
    from turnstile.bench.quality_bench import measure

    report = measure(new_tokens=16, paths=("gguf",))
    ratio = report["gguf"].perplexity / report["float32"].perplexity
    assert 0.99 < ratio < 1.01, report
    assert report["gguf"].same_prefix > 0  # it generates text, not noise


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (dict(backend="torch"), "runs on the cpu backend, not the torch backend"),
        (dict(tensor_parallel_size=2), "runs on one rank"),
        (dict(model="/models/a-safetensors-folder"), "needs a GGUF file, not /models/a-safet"),
    ],
)
def test_settings_the_quantized_path_does_not_run_are_refused(flags: dict, refusal: str) -> None:
    """Refused at start, by name: the backend asks before any weight is read."""
    from turnstile.executor_svc.backends import create_backend
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.shared.model_info import embedded_model_path, read_model_info
    from turnstile.shared.settings import build

    config = build(RunnerConfig, quantization="gguf", **flags)
    backend = create_backend(config, read_model_info(embedded_model_path()))
    with pytest.raises(ValueError, match=refusal):
        backend.keeps_quantized()


def test_rows_of_mixed_formats_stack_dense() -> None:
    """A file that stores v in another format than q and k (Q4_K_M files do): the stacked qkv
    is dense, the parts' exact values; one format stays quantized."""
    from turnstile.executor_svc.model.llama import stack_rows

    q, v = _weight(Q.Q4_1, 8, 64), _weight(Q.Q8_0, 4, 64)
    dense = torch.randn(4, 64)
    mixed = stack_rows([q, v], torch.float32)
    assert torch.equal(mixed, torch.cat((q.dequantize(), v.dequantize())))
    assert torch.equal(stack_rows([q, dense], torch.float32), torch.cat((q.dequantize(), dense)))
    assert isinstance(stack_rows([q, q], torch.float32), QuantizedWeight)
