"""The native CPU kernels (kernels/native/*.c) against torch: projections with float32 and
bfloat16 weights, paged decode attention, and the fallbacks where they cannot run. Their build:
test_native_build.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kernels import DIM, HEADS, paged_setup

from turnstile.executor_svc.backends import backend_name
from turnstile.executor_svc.backends.packed_projection import PackedProjection
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.kernels import cpu_native, native_attention, native_sampling, reference
from turnstile.shared.settings import build


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 13, 64])
@pytest.mark.parametrize("outputs", [40, 72])
def test_linear_matches_torch_with_bias_and_residual(
    weight_dtype: torch.dtype, rows: int, outputs: int
) -> None:
    # 40 outputs: two whole panels of 16 and a partial one; 72: a group of four panels (the
    # wide tile one or two leftover rows take) and a partial fifth. 37 inputs: no multiple of 8.
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(outputs, 37, generator=generator).to(weight_dtype)
    bias = torch.randn(outputs, generator=generator)
    x = torch.randn(rows, 37, generator=generator)
    residual = torch.randn(rows, outputs, generator=generator)
    exact = F.linear(x, weight.float(), bias)
    plain = PackedProjection(weight, None)
    biased = PackedProjection(weight, bias)
    torch.testing.assert_close(plain(x), F.linear(x, weight.float()), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(biased(x), exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(biased(x, residual), exact + residual, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_projection_does_not_depend_on_the_rows_beside_it(
    weight_dtype: torch.dtype,
) -> None:
    """Full tiles, leftover rows and the wide tiles all sum in the same order, so a sequence
    gets the same bits alone or in any batch (greedy tokens do not change with the batch)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 576, generator=generator).to(weight_dtype)
    x = torch.randn(15, 576, generator=generator)
    layer = PackedProjection(weight, None)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("vocab", [5, 8, 13, 49157])
def test_argmax_picks_what_torch_picks(rows: int, vocab: int) -> None:
    """Greedy tokens: the first of tied largest logits, the first NaN, all -inf."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=generator)
    ties = (logits * 2).round()  # few distinct values: the largest one repeats
    with_nans = logits.clone()
    with_nans[:, [vocab // 3, vocab - 1]] = float("nan")
    masked = torch.full((rows, vocab), -float("inf"))
    for case in (logits, ties, with_nans, masked):
        assert torch.equal(native_sampling.argmax(case), case.argmax(dim=-1))


def test_linear_accepts_a_non_contiguous_input_and_residual() -> None:
    weight = torch.randn(32, 24)
    x = torch.randn(24, 5).t()
    residual = torch.randn(32, 5).t()
    got = PackedProjection(weight, None)(x, residual)
    torch.testing.assert_close(got, x @ weight.t() + residual, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", native_attention.CACHE_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
# 20: windows that start mid-block; soft cap 0.5 (Gemma 2's is 50, on scores 100x these)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (20, 0.0), (20, 0.5)])
def test_paged_decode_matches_reference(
    cache_dtype: torch.dtype, block_size: int, window: int, softcap: float
) -> None:
    # Ragged, partial last blocks, 9 query heads on 3 KV heads, and rows of 8+ tokens (the
    # kernel scores eight at a time) next to shorter ones; float32 queries on either cache.
    seq_lens = [1, 7, 8, 15, 16, 17, 40, 97, 250]
    k_cache, v_cache, tables, lens = paged_setup(seq_lens, block_size, cache_dtype)
    query = torch.randn(len(seq_lens), HEADS, DIM)
    plan = reference.plan_decode(tables, lens, block_size)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, plan, DIM**-0.5, window,
                                                softcap)  # fmt: skip
    got = native_attention.paged_decode_attention(
        query, k_cache, v_cache, plan, DIM**-0.5, window, softcap, tiles=False
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 20])
def test_attention_sinks_match_reference(cache_dtype: torch.dtype, window: int) -> None:
    """gpt-oss's sinks on the float32 rows (the tiles': test_attention_tiles), rows long
    enough to be split into parts, each part's total merged before the sink joins."""
    seq_lens = [1, 17, 97, 700]
    k_cache, v_cache, tables, lens = paged_setup(seq_lens, 16, cache_dtype)
    query = torch.randn(len(seq_lens), HEADS, DIM)
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(3)) + 1.0
    plan = reference.plan_decode(tables, lens, 16)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, plan, DIM**-0.5, window,
                                                0.0, sinks)  # fmt: skip
    got = native_attention.paged_decode_attention(
        query, k_cache, v_cache, plan, DIM**-0.5, window, 0.0, sinks, tiles=False
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seq_lens", [[700], [300, 1], [33, 129, 64]])
@pytest.mark.parametrize("magnitude", [1, 300])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (203, 0.0), (203, 30.0)])
def test_few_rows_split_their_context_and_merge_to_the_reference(
    seq_lens: list[int], magnitude: float, window: int, softcap: float
) -> None:
    """With fewer rows than tasks the threads want, each row's context is scored in several
    parts (a part of 33 tokens ends mid-block; a window's first part starts mid-block) whose
    softmaxes are merged; large scores test the merge's rescaling (and, soft-capped, that the
    merge rescales capped scores)."""
    k_cache, v_cache, tables, lens = paged_setup(seq_lens, 16, torch.float32, seed=len(seq_lens))
    generator = torch.Generator().manual_seed(len(seq_lens))
    query = torch.randn(len(seq_lens), HEADS, DIM, generator=generator) * magnitude
    expected, got = _both_decodes(query, k_cache, v_cache, tables, lens, window, softcap)
    torch.testing.assert_close(got, expected, atol=1e-5 * magnitude, rtol=0)


def prompt_and_shared_prefix(
    heads: int, kv_heads: int, dim: int, cache_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]], torch.Tensor, torch.Tensor,
           torch.Tensor]:  # fmt: skip
    """A 150-token prompt's rows, a row of a request that shares its first five blocks (prefix
    caching), then the prompt's rows again, unsorted: the caches, the rows as (request,
    length), their tables, lengths and queries."""
    generator = torch.Generator().manual_seed(heads + dim)
    k_cache, v_cache = (
        torch.randn(25, 16, kv_heads, dim, generator=generator).to(cache_dtype) for _ in "kv"
    )
    tables = torch.randperm(25, generator=generator)[:20].view(2, 10)
    tables[1, :5] = tables[0, :5]
    rows = [(0, n) for n in range(1, 151)] + [(1, 120)] + [(0, n) for n in range(100, 59, -3)]
    table_rows = tables[[request for request, _ in rows]]
    lens = torch.tensor([n for _, n in rows], dtype=torch.int64)
    query = torch.randn(len(rows), heads, dim, generator=generator)
    return k_cache, v_cache, rows, table_rows, lens, query


def each_alone(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table_rows: torch.Tensor,
    lens: torch.Tensor,
    *args: float,
    **options: str | bool,
) -> torch.Tensor:
    """Native attention on each row alone, as a decode row."""
    return torch.cat([
        native_attention.paged_decode_attention(
            query[i : i + 1], k_cache, v_cache,
            reference.plan_decode(table_rows[i : i + 1], lens[i : i + 1], 16), *args, **options,
        )
        for i in range(len(lens))
    ])  # fmt: skip


# Query heads on KV heads: groups of 3 (one wide pass), 4 (3 then 1), 5 (3 then 2) and 1; a
# head_dim of 72 sums 64 dims, then 8.
GEOMETRIES = [(9, 3, 64), (8, 2, 72), (10, 2, 64), (4, 4, 32)]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), GEOMETRIES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 40])
def test_a_prompts_rows_read_each_block_once_and_get_the_bits_they_get_alone(
    heads: int, kv_heads: int, dim: int, cache_dtype: torch.dtype, window: int
) -> None:
    """A prompt's tokens are rows with one block table, which the kernel scores together a
    block at a time, several query heads a key on AVX-512. Each row must still get the bits it
    gets alone on AVX2, as a decode row, so that a token's result depends on neither its step
    nor the CPU. Here: a 150-token prompt's rows, a request that shares its first five blocks
    (prefix caching), then the prompt's rows again, unsorted."""
    k_cache, v_cache, rows, table_rows, lens, query = prompt_and_shared_prefix(
        heads, kv_heads, dim, cache_dtype
    )
    plan = reference.plan_decode(table_rows, lens, 16)
    alone = each_alone(query, k_cache, v_cache, table_rows, lens, 0.125, window, isa="avx2",
                       tiles=False)  # fmt: skip
    for isa in cpu_native.usable_isas():
        together = native_attention.paged_decode_attention(
            query, k_cache, v_cache, plan, 0.125, window, isa=isa, tiles=False
        )
        differ = (together != alone).any(dim=(1, 2)).nonzero().flatten().tolist()
        assert not differ, (isa, [rows[i] for i in differ])
    expected = reference.paged_decode_attention(query, k_cache, v_cache, plan, 0.125, window)
    torch.testing.assert_close(alone, expected, atol=1e-5, rtol=0)


def test_softmax_is_stable_for_large_scores() -> None:
    """Scores in the thousands would overflow a naive exp; the kernel subtracts the max."""
    k_cache, v_cache, tables, lens = paged_setup([33, 5], 16, torch.float32, seed=3)
    query = torch.randn(2, HEADS, DIM, generator=torch.Generator().manual_seed(3)) * 300
    expected, got = _both_decodes(query, k_cache, v_cache, tables, lens)
    assert torch.isfinite(got).all()
    # Scores near 2,400 carry float32 rounding of ~1e-3, which the softmax turns into output
    # differences up to ~1.5e-4 for some queries (2 of 200 seeds exceeded 1e-4, with this
    # kernel and the one before it): hence a seeded query and this bound.
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)


def _both_decodes(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    plan = reference.plan_decode(tables, lens, 16)
    expected, got = (
        kernels.paged_decode_attention(query, k_cache, v_cache, plan, DIM**-0.5, window, softcap)
        for kernels in (reference, native_attention)
    )
    return expected, got


def test_backend_choice_follows_the_device_dtype_and_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def name(**options: str) -> str:
        return backend_name(build(RunnerConfig, model="model", **options))

    assert name() == "cpu"
    assert name(dtype="bfloat16") == "cpu"
    assert name(dtype="float16") == "torch"  # the native kernels take fp32 and bf16 weights
    assert name(device="cuda:0") == "cuda"
    assert name(backend="torch") == "torch"
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        name(backend="fast")
    k_cache, v_cache, tables, lens = paged_setup([5], 16, torch.float64)
    plan = reference.plan_decode(tables, lens, 16)
    with pytest.raises(ValueError, match="float32, 16-bit or fp8 cache"):
        native_attention.paged_decode_attention(
            torch.randn(1, HEADS, DIM), k_cache, v_cache, plan, 1.0
        )
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    assert name() == "torch"
    logits = torch.randn(3, 50)
    assert torch.equal(native_sampling.argmax(logits), logits.argmax(dim=-1))
