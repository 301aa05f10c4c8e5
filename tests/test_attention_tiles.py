"""Attention over a bfloat16 cache on AMX-BF16 tiles (kernels/native/attention_tiles.c): its
numbers (bf16 queries and probabilities, fp32 sums) against a torch model of them, and a row's
bits, which must not depend on the rows beside it nor on the step it is in."""

from __future__ import annotations

import pytest
import torch
from test_kernels import DIM, HEADS, paged_setup
from test_native_kernels import each_alone, prompt_and_shared_prefix

from turnstile.kernels import cpu_native, native_attention, reference

amx = pytest.mark.skipif(not cpu_native.amx_tiles(), reason="this CPU has no AMX-BF16 tiles")


def modelled(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """What the tiles compute, in torch: queries rounded to bf16, scores and their softmax
    numerators in fp32, the numerators rounded to bf16 to weigh the values, their fp32 sum."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // kv_heads
    out = torch.empty_like(query)
    for row, length in enumerate(lens.tolist()):
        tokens = torch.arange(max(0, length - window) if window else 0, length)
        slots = tables[row, tokens // block_size] * block_size + tokens % block_size
        keys, values = (cache.flatten(0, 1)[slots].float() for cache in (k_cache, v_cache))
        q = query[row].bfloat16().float()
        scores = torch.einsum("hd,thd->ht", q, keys.repeat_interleave(group, dim=1))
        if softcap:
            scores = softcap / scale * torch.tanh(scores * scale / softcap)
        p = torch.exp((scores - scores.amax(dim=1, keepdim=True)) * scale)
        weighed = torch.einsum("ht,thd->hd", p.bfloat16().float(),
                               values.repeat_interleave(group, dim=1))  # fmt: skip
        out[row] = weighed / p.sum(dim=1, keepdim=True)
    return out


@amx
@pytest.mark.parametrize("block_size", [16, 32])
# 20: windows that start mid-chunk; soft cap 0.5 (Gemma 2's is 50, on scores 100x these)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (20, 0.0), (20, 0.5)])
def test_tiles_compute_what_their_model_computes(
    block_size: int, window: int, softcap: float
) -> None:
    """Ragged rows, partial chunks and blocks, 9 query heads on 3 KV heads; large queries make
    the softmax's shift matter. Close to the model: its exp is torch's, whose last bits, where a
    numerator lies near a bf16 rounding boundary, round it the other way (2^-8 of its weight);
    and, at unit scale, within 1e-2 of float32 attention (the roundings' cost)."""
    seq_lens = [1, 7, 8, 15, 16, 17, 33, 40, 97, 250]
    k_cache, v_cache, tables, lens = paged_setup(seq_lens, block_size, torch.bfloat16)
    query = torch.randn(len(seq_lens), HEADS, DIM, generator=torch.Generator().manual_seed(7))
    for magnitude in (1, 30):
        plan = reference.plan_decode(tables, lens, block_size)
        got = native_attention.paged_decode_attention(
            query * magnitude, k_cache, v_cache, plan, DIM**-0.5, window, softcap, tiles=True
        )
        model = modelled(query * magnitude, k_cache, v_cache, tables, lens, DIM**-0.5, window,
                         softcap)  # fmt: skip
        exact = reference.paged_decode_attention(
            query * magnitude, k_cache, v_cache, plan, DIM**-0.5, window, softcap
        )
        torch.testing.assert_close(got, model, atol=3e-3, rtol=0)
        if magnitude == 1:
            torch.testing.assert_close(got, exact, atol=1e-2, rtol=0)


@amx
@pytest.mark.parametrize("window", [0, 20])
def test_tiles_add_attention_sinks(window: int) -> None:
    """gpt-oss's sinks on the tiles, each lane's own head's: within the tiles' rounding of
    float32 attention with them, and far from it without."""
    seq_lens = [1, 17, 40, 250]
    k_cache, v_cache, tables, lens = paged_setup(seq_lens, 16, torch.bfloat16)
    query = torch.randn(len(seq_lens), HEADS, DIM, generator=torch.Generator().manual_seed(7))
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(3)) + 1.0
    plan = reference.plan_decode(tables, lens, 16)
    got = native_attention.paged_decode_attention(
        query, k_cache, v_cache, plan, DIM**-0.5, window, 0.0, sinks, tiles=True
    )
    args = (query, k_cache, v_cache, plan, DIM**-0.5, window, 0.0)
    torch.testing.assert_close(got, reference.paged_decode_attention(*args, sinks), atol=1e-2,
                               rtol=0)  # fmt: skip
    assert (got - reference.paged_decode_attention(*args)).abs().max() > 0.05


# Query heads on KV heads, head_dim: groups of 3, 4 and 5, one; dims of one, two, three and
# four 32-dim slices (128: two passes of 64 output dims).
GEOMETRIES = [(9, 3, 64), (8, 2, 128), (10, 2, 64), (4, 4, 32), (6, 2, 96)]


@amx
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), GEOMETRIES)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (40, 0.0), (40, 0.5)])
def test_a_rows_bits_on_the_tiles_do_not_depend_on_its_step(
    heads: int, kv_heads: int, dim: int, window: int, softcap: float
) -> None:
    """A 150-token prompt's rows, a decode row of a request that shares its first five blocks
    (prefix caching), then the prompt's rows again, unsorted, all in one call: each row must
    get the bits it gets alone, as a decode row, so that a token's result depends neither on
    the rows that share its tile nor on whether it was a prompt's or a decode's."""
    k_cache, v_cache, rows, table_rows, lens, query = prompt_and_shared_prefix(
        heads, kv_heads, dim, torch.bfloat16
    )
    together = native_attention.paged_decode_attention(
        query, k_cache, v_cache, reference.plan_decode(table_rows, lens, 16), 0.125, window,
        softcap, tiles=True,
    )  # fmt: skip
    alone = each_alone(query, k_cache, v_cache, table_rows, lens, 0.125, window, softcap,
                       tiles=True)  # fmt: skip
    differ = (together != alone).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert not differ, [rows[i] for i in differ]
    model = modelled(query, k_cache, v_cache, table_rows, lens, 0.125, window, softcap)
    torch.testing.assert_close(together, model, atol=3e-3, rtol=0)


@amx
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), GEOMETRIES)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (40, 0.5)])
def test_decode_rows_whose_tiles_take_several_kv_heads_keep_their_bits(
    heads: int, kv_heads: int, dim: int, window: int, softcap: float
) -> None:
    """Enough decode rows (four a thread, and more) that a row's tile takes the query heads of
    several KV heads, two rows sharing their first blocks (one group): each row must get the
    bits it gets alone, where its tiles take one KV head each (too few rows: split by head)."""
    rows = 4 * torch.get_num_threads() + 6
    generator = torch.Generator().manual_seed(heads * dim + window)
    k_cache, v_cache = (
        torch.randn(rows * 8, 16, kv_heads, dim, generator=generator).bfloat16() for _ in "kv"
    )
    tables = torch.randperm(rows * 8, generator=generator).view(rows, 8)
    tables[1, :3] = tables[0, :3]
    lens = torch.randint(1, 128, (rows,), generator=generator)
    lens[0], lens[1] = 100, 40
    query = torch.randn(rows, heads, dim, generator=generator)
    plan = reference.plan_decode(tables, lens, 16)
    together = native_attention.paged_decode_attention(
        query, k_cache, v_cache, plan, 0.125, window, softcap, tiles=True
    )
    alone = each_alone(query, k_cache, v_cache, tables, lens, 0.125, window, softcap,
                       tiles=True)  # fmt: skip
    assert not (together != alone).any(dim=(1, 2)).nonzero().flatten().tolist()
    model = modelled(query, k_cache, v_cache, tables, lens, 0.125, window, softcap)
    torch.testing.assert_close(together, model, atol=3e-3, rtol=0)


@amx
@pytest.mark.parametrize("window", [0, 9, 40])
def test_a_row_weighs_exactly_the_tokens_it_sees(window: int) -> None:
    """Values that are one-hot in their token's position: each output dim is that token's
    weight, which must be exactly 0 where the row does not see it (past its end, before its
    window) and positive where it does, for rows ending anywhere in a chunk."""
    lens = list(range(1, 65))
    k_cache, _, tables, lens_t = paged_setup(lens, 16, torch.bfloat16, seed=window)
    v_cache = torch.zeros_like(k_cache)
    for row, length in enumerate(lens):
        for t in range(length):
            v_cache[tables[row, t // 16], t % 16, :, t] = 1.0
    query = torch.randn(len(lens), HEADS, DIM, generator=torch.Generator().manual_seed(1))
    plan = reference.plan_decode(tables, lens_t, 16)
    out = native_attention.paged_decode_attention(query, k_cache, v_cache, plan, 0.125, window,
                                                  tiles=True)  # fmt: skip
    for row, length in enumerate(lens):
        seen = torch.zeros(DIM, dtype=torch.bool)
        seen[max(0, length - window) if window else 0 : length] = True
        assert (out[row][:, ~seen] == 0).all() and (out[row][:, seen] > 0).all(), row


def test_tiles_are_asked_for_only_where_the_cpu_has_them() -> None:
    """Asked for where the CPU has no AMX-BF16, the tiles are refused by name, never run (an
    illegal instruction); where it has them, they are the default for a bf16 cache."""
    k_cache, v_cache, tables, lens = paged_setup([40], 16, torch.bfloat16)
    query = torch.randn(1, HEADS, DIM)
    plan = reference.plan_decode(tables, lens, 16)
    if not cpu_native.amx_tiles():
        with pytest.raises(ValueError, match="AMX tiles"):
            native_attention.paged_decode_attention(query, k_cache, v_cache, plan, 1.0, tiles=True)
        return
    default, tiles, rows = (
        native_attention.paged_decode_attention(query, k_cache, v_cache, plan, 1.0, tiles=t)
        for t in (None, True, False)
    )
    assert torch.equal(default, tiles) and not torch.equal(tiles, rows)
