"""Prompt chunks' attention on the CPU run as rows (`native_attention.paged_prefill_attention`):
each prompt token a decode row attending its sequence up to itself, where the cache is on AMX
tiles or the chunk has a window, soft cap or sinks; the torch reference's SDPA elsewhere."""

from __future__ import annotations

import pytest
import torch
from test_kernels import DIM, HEADS, paged_setup

from turnstile.kernels import cpu_native, native_attention, reference
from turnstile.kernels.reference import PrefillPlan

amx = pytest.mark.skipif(not cpu_native.amx_tiles(), reason="this CPU has no AMX-BF16 tiles")

# Rows of (cached or earlier-computed context, new tokens): a chunk from the start, chunks
# after a prefix ending mid-block, and a long one whose window starts mid-block.
CHUNKS = [(0, 23), (37, 5), (16, 40), (150, 70)]
SINKS = torch.randn(HEADS, generator=torch.Generator().manual_seed(5)) + 1.0
# (window, softcap, sinks): 20, a window that starts mid-block; soft cap 0.5 on scores like these
EXTRAS = {"window": (20, 0.0, None), "softcap": (0, 0.5, None), "sinks": (0, 0.0, SINKS),
          "all three": (20, 0.5, SINKS)}  # fmt: skip


def _chunks(cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, PrefillPlan,
                                              torch.Tensor, torch.Tensor]:  # fmt: skip
    """The caches, the chunks' plan, their queries, and each token's KV length."""
    k_cache, v_cache, tables, lens = paged_setup([c + n for c, n in CHUNKS], 16, cache_dtype)
    news = torch.tensor([n for _, n in CHUNKS])
    start = torch.cat([torch.zeros(1, dtype=torch.int64), news.cumsum(0)])
    plan = PrefillPlan(tables, lens, start, int(news.max()), from_start=False)
    query = torch.randn(int(news.sum()), HEADS, DIM, generator=torch.Generator().manual_seed(1))
    each = torch.cat([torch.arange(c + 1, c + n + 1) for c, n in CHUNKS])
    return k_cache, v_cache, plan, query, each


def _decode_rows_bits_near_the_reference(
    cache_dtype: torch.dtype, extras: tuple, tiles: bool, atol: float
) -> None:
    """The chunks' attention as prefill: each token's bits as a decode row of its own, within
    `atol` of the torch reference's prefill."""
    k_cache, v_cache, plan, query, each = _chunks(cache_dtype)
    owner = torch.repeat_interleave(torch.arange(len(CHUNKS)), plan.query_start.diff())
    rows = reference.plan_decode(plan.block_tables[owner], each, 16)
    args = (0.125, *extras)
    prefill = native_attention.paged_prefill_attention(
        query, k_cache, v_cache, plan, *args, tiles=tiles
    )
    decode = native_attention.paged_decode_attention(
        query, k_cache, v_cache, rows, *args, tiles=tiles
    )
    assert torch.equal(prefill, decode)
    expected = reference.paged_prefill_attention(query, k_cache, v_cache, plan, *args)
    torch.testing.assert_close(prefill, expected, atol=atol, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extras", EXTRAS.values(), ids=EXTRAS.keys())
def test_a_chunks_tokens_get_their_decode_rows_bits_and_the_references_numbers(
    cache_dtype: torch.dtype, extras: tuple
) -> None:
    """Off the tiles, so on any CPU: the same bits as each token decoded (so a token's result
    does not depend on the route that computed it), within 5e-5 of the torch reference (the
    soft cap's tanh is not torch's to the last bit)."""
    _decode_rows_bits_near_the_reference(cache_dtype, extras, tiles=False, atol=5e-5)


def test_plain_chunks_on_float32_stay_the_references() -> None:
    """No window, soft cap or sinks, off the tiles: the reference's batched attention (faster
    there: docs/benchmarks.md), its very bits."""
    k_cache, v_cache, plan, query, _ = _chunks(torch.float32)
    got = native_attention.paged_prefill_attention(query, k_cache, v_cache, plan, 0.125)
    assert torch.equal(got, reference.paged_prefill_attention(query, k_cache, v_cache, plan, 0.125))


@amx
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("extras", [(0, 0.0, None), *EXTRAS.values()])
def test_on_the_tiles_every_chunk_runs_as_rows(cache_dtype: torch.dtype, extras: tuple) -> None:
    """A bf16 or fp8 cache on the tiles, plain chunks too: each token's decode row's bits,
    within the tiles' rounding (1e-2, as `test_attention_tiles`) of the torch reference."""
    _decode_rows_bits_near_the_reference(cache_dtype, extras, tiles=True, atol=1e-2)


def test_the_cpu_backend_attends_prompt_chunks_natively() -> None:
    from turnstile.executor_svc.backends import create_backend
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.shared.model_info import embedded_model_path, read_model_info
    from turnstile.shared.settings import build

    backend = create_backend(build(RunnerConfig), read_model_info(embedded_model_path()))
    prefill = backend.attention.prefill
    assert prefill.func is native_attention.paged_prefill_attention  # type: ignore[attr-defined]
    assert prefill.keywords == {"tiles": backend.attention_tiles}  # type: ignore[attr-defined]
