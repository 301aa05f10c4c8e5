"""GGUF blocks kept quantized (#25): unpacked to the file's values (the K-quants' sub-block scales
rounded to fp16), multiplied by the native kernels on every ISA this CPU has as the torch
reference multiplies them, a row's result the same in any batch; the embedded model served on
them generates alike on every route and loses under 1% perplexity against float32 (a 1B model:
test_one_b_model.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_models import SCALES, random_blocks

from turnstile.kernels import cpu_native
from turnstile.kernels.gguf_blocks import dequantized, from_gguf
from turnstile.kernels.quantized_weights import (
    FP4,
    Q,
    QuantizedWeight,
    StackedWeight,
    pack,
    reference_linear,
)

KINDS = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K]
K_QUANTS = (Q.Q4_K, Q.Q6_K)  # gguf cannot quantize these: their blocks are drawn at random
needs_native = pytest.mark.skipif(cpu_native.library() is None, reason="no native CPU kernels")


def _weight(kind: gguf.GGMLQuantizationType, rows: int, inputs: int) -> QuantizedWeight:
    if kind in K_QUANTS:
        return from_gguf(random_blocks(kind, rows, inputs), kind)
    values = np.random.default_rng(rows).normal(0, 0.05, (rows, inputs)).astype(np.float32)
    values[:, :32] += 0.2  # a block whose offset (Q4_1's m) is far from zero
    return from_gguf(gguf.quants.quantize(values, kind), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_blocks_unpack_to_the_files_values(kind: gguf.GGMLQuantizationType) -> None:
    """Exactly; the K-quants' sub-block scales (d * sc, float32 in the file's dequantization)
    rounded to fp16: at most 2**-11 of each term. Dequantized with float32 scales (a load
    without `quantized`): gguf's values bit for bit."""
    if kind in K_QUANTS:
        data = random_blocks(kind, 7, 512)
    else:
        values = np.random.default_rng(0).normal(0, 0.1, (7, 96)).astype(np.float32)
        data = gguf.quants.quantize(values, kind)
    expected = torch.from_numpy(gguf.quants.dequantize(data, kind).astype(np.float32))
    assert torch.equal(dequantized(data, kind), expected)
    weight = from_gguf(data, kind)
    terms = weight.codes.float().view(7, -1, weight.group) * weight.scale.float()[..., None]
    bound = 2**-11 * (terms.abs() + weight.offset.float().abs()[..., None]).view(7, -1)
    if kind in K_QUANTS:
        assert ((weight.dequantize() - expected).abs() <= bound).all()
        d = SCALES[kind][0]  # a d whose sub-block scales d * sc pass fp16's range: refused
        data.reshape(7, 2, -1)[..., d : d + 2] = np.array([6e4], np.float16).view(np.uint8)
        with pytest.raises(ValueError, match=f"{kind.name} block's scale or offset overflows"):
            from_gguf(data, kind)
    else:
        assert torch.equal(weight.dequantize(), expected)
    assert weight.group == (16 if kind == Q.Q6_K else 32)


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_the_quantized_product_is_the_reference_on_every_isa(
    kind: gguf.GGMLQuantizationType,
) -> None:
    weight = _weight(kind, 100, 768)  # 100 features: a last, partial panel
    packed = pack(weight).panels
    bias, generator = torch.randn(100), torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 5, 6, 7, 13):  # every tile shape, full tiles and rests
        x = torch.randn(rows, 768, generator=generator)
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
@pytest.mark.parametrize("bits", [4, FP4, 6, 8])
def test_the_quantized_products_integer_sums_hold_at_their_bounds(bits: int) -> None:
    """Every code at its largest (and 8-bit and MXFP4 codes also at their smallest) times
    activations at +-127: AVX2 sums products in int16 for as many groups as it holds
    (quantized_avx2.c)."""
    offset = {4: 0.5, FP4: -12.0, 6: -32.0, 8: -128.0}[bits]  # Q6_K's, MXFP4's, Q8_0's m / d
    group = 16 if bits == 6 else 32
    largest = 24 if bits == FP4 else 2**bits - 1
    for code in (largest, 0) if bits in (FP4, 8) else (largest,):
        codes = torch.full((32, 256), code, dtype=torch.uint8)
        scale = torch.full((32, 256 // group), 0.01, dtype=torch.float16)
        weight = QuantizedWeight(codes, scale, (scale.float() * offset).half(), bits)
        x = torch.ones(4, 256) * torch.tensor([[1.0], [-1.0], [0.5], [-3.0]])
        expected = reference_linear(x, weight)
        for isa in cpu_native.usable_isas():
            result = cpu_native.linear_quantized(x, pack(weight).panels, 32, bits, isa=isa)
            torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)


@needs_native
def test_a_row_of_the_quantized_product_does_not_depend_on_its_batch() -> None:
    """Recomputing a preempted sequence alone must give the bits it had in a batch."""
    weight = _weight(Q.Q4_1, 64, 256)
    packed = pack(weight).panels
    # 1,103 rows: in blocks of rows against every panel in turn (quantized.c), then a rest.
    for x, rows in ((torch.randn(13, 256), (0, 5, 12)), (torch.randn(1103, 256), (0, 700, 1102))):
        together = cpu_native.linear_quantized(x, packed, 64, 4)
        for row in rows:
            alone = cpu_native.linear_quantized(x[row : row + 1], packed, 64, 4)
            assert torch.equal(alone[0], together[row])
    torch.testing.assert_close(together, reference_linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_rows_are_picked_and_stacked_as_dense_rows(
    kind: gguf.GGMLQuantizationType,
) -> None:
    """The model reorders q and k rows and stacks q, k, v: the same on blocks as on values."""
    a, b = _weight(kind, 8, 256), _weight(kind, 4, 256)
    order = torch.tensor([3, 0, 7, 1])
    assert torch.equal(a[order].dequantize(), a.dequantize()[order])
    stacked = QuantizedWeight.cat([a, b]).dequantize()
    assert torch.equal(stacked, torch.cat((a.dequantize(), b.dequantize())))
    packed = pack(QuantizedWeight.cat([a, b]))  # an embedding's rows, from its panels
    assert torch.equal(packed.rows(torch.tensor([11, 2, 11, 5])), stacked[[11, 2, 11, 5]])
    with pytest.raises(ValueError, match="one code width"):
        QuantizedWeight.cat([a, _weight(Q.Q8_0 if kind != Q.Q8_0 else Q.Q4_0, 4, 256)])


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_embedded_models_blocks_generate_alike_on_every_route(kv_cache_dtype: str) -> None:
    """Prompts run together in 32-token chunks with too few KV blocks (preempted, recomputed;
    the fused decode layers and the model's layers both run) give each prompt's tokens alone,
    on the default bfloat16 KV cache and on an fp8 one."""
    from conftest import fixed_length_requests

    from turnstile.bench.parity_bench import prompt_ids
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.offline import OfflineEngine
    from turnstile.shared.config import SchedulingConfig
    from turnstile.shared.protocol import SamplingParams
    from turnstile.shared.settings import build

    prompts = prompt_ids()[:4]
    requests = fixed_length_requests(prompts, SamplingParams(), 40)
    flags = dict(quantization="gguf", kv_cache_dtype=kv_cache_dtype)
    crowded = OfflineEngine(build(RunnerConfig, **flags, num_blocks=12, max_num_seqs=4),
                            SchedulingConfig(max_num_batched_tokens=32))  # fmt: skip
    assert crowded.runner.quantized
    together = [r.token_ids for r in crowded.generate(requests)]
    assert crowded.scheduler.stats.num_preemptions > 0
    assert crowded.scheduler.pool.num_free == 12
    alone = OfflineEngine(build(RunnerConfig, **flags, num_blocks=64))
    assert together == [alone.generate([r])[0].token_ids for r in requests]


@pytest.mark.slow
@needs_native
def test_the_gguf_blocks_lose_under_one_percent_perplexity_to_float32() -> None:
    """And so do they with an fp8 (e4m3) KV cache, values of no scale saturated to its range."""
    from turnstile.bench.quality_bench import measure

    # On AMX-INT8 the default takes the int8 tiles: the blocks' products measured beside them.
    paths = ("gguf", "gguf, fp8 (e4m3) KV")
    paths += ("gguf, blocks products",) if cpu_native.amx_int8() else ()
    report = measure(new_tokens=16, paths=paths)
    for path in paths:
        assert 0.99 < report[path].perplexity / report["float32"].perplexity < 1.01, report
        assert report[path].same_prefix > 0  # it generates text, not noise


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


def test_rows_of_mixed_formats_stack_as_parts_of_one_product() -> None:
    """Q4_K_M files store v in Q6_K, q and k in Q4_K: one projection over each format's panels,
    as each part's own product; parts that are not whole panels (16 rows) stack dense."""
    from turnstile.executor_svc.backends.packed_projection import QuantizedProjection
    from turnstile.executor_svc.model.layer_weights import stack_rows

    q, k, v = _weight(Q.Q4_K, 32, 256), _weight(Q.Q4_0, 16, 256), _weight(Q.Q6_K, 20, 256)
    stacked = stack_rows([q, k, v], torch.float32)
    assert isinstance(stacked, StackedWeight) and [p.bits for p in stacked.parts] == [4, 6]
    values = torch.cat((q.dequantize(), k.dequantize(), v.dequantize()))
    assert torch.equal(stacked.dequantize(), values)
    if cpu_native.library() is not None:
        bias, x, residual = torch.randn(68), torch.randn(5, 256), torch.randn(5, 68)
        projection = QuantizedProjection([pack(part) for part in stacked.parts], bias)
        expected = torch.cat([reference_linear(x, part) for part in stacked.parts], dim=1)
        torch.testing.assert_close(projection(x, residual), expected + bias + residual)
    uneven, dense = _weight(Q.Q4_1, 8, 256), torch.randn(4, 256)
    mixed = stack_rows([uneven, v], torch.float32)
    assert torch.equal(mixed, torch.cat((uneven.dequantize(), v.dequantize())))
    assert torch.equal(stack_rows([q, dense], torch.float32), torch.cat((q.dequantize(), dense)))
    assert isinstance(stack_rows([q, k], torch.float32), QuantizedWeight)
