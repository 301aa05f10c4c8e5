"""Attention on the CPU, reading the paged cache in place (`kernels/native/attention.c`): decode
rows, and prompt tokens run as rows of their own (as the fused layers run them) where that is
faster than the torch reference's batched prefill. KV writes stay the reference's."""

from __future__ import annotations

import torch

from turnstile.kernels import cpu_native, reference
from turnstile.kernels.reference import DecodePlan, PrefillPlan

# What attention.c and decode_layer.c read, numbered as their KV formats (simd.h).
CACHE_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2
)  # fmt: skip


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    isa: str | None = None,
    tiles: bool | None = None,
) -> torch.Tensor:
    """One float32 query token per row ([rows, heads, head_dim]) against its row's paged KV,
    in any of `CACHE_DTYPES` (its last `window` tokens with a window; scores soft-capped where
    `softcap`; `sinks` [heads]: a logit a head in its softmax's sum); on `isa` (default the
    best), which changes the speed, never the bits. `tiles` (default: where the CPU has them):
    a bfloat16 or fp8 cache on AMX-BF16 tiles, bf16 products summed in float32, so other bits
    than the rows' float32."""
    lib = cpu_native.library()
    assert lib is not None
    query = query.contiguous()
    rows, heads, dim = query.shape
    kv_heads = k_cache.shape[2]
    # The C kernel reads int64 rows in place; the executor's staged tables already are.
    tables = plan.block_tables.to(torch.int64).contiguous()
    lens = plan.seq_lens.to(torch.int64).contiguous()
    if dim % 8 or heads % kv_heads or k_cache.dtype not in CACHE_DTYPES:
        raise ValueError(
            "native decode attention needs a float32, 16-bit or fp8 cache and "
            f"head_dim % 8 == 0, got {k_cache.dtype} and {dim}"
        )
    if tiles is None:
        tiles = cpu_native.amx_tiles()
    elif tiles and not cpu_native.amx_tiles():  # which also asks Linux for the tiles' state
        raise ValueError("attention on AMX tiles needs a CPU with AMX-BF16 and AVX512-BF16")
    out = torch.empty_like(query)
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    status = lib.paged_decode_attention(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        CACHE_DTYPES.index(k_cache.dtype),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        out.data_ptr(),
        rows,
        heads,
        kv_heads,
        dim,
        plan.block_size,
        scale,
        window,
        softcap,
        None if sinks is None else sinks.data_ptr(),
        cpu_native.ISAS.index(isa or cpu_native.best_isa()),
        tiles,
    )
    if status:
        raise MemoryError("native decode attention could not allocate its scores")
    return out


def on_tiles(cache: torch.Tensor, tiles: bool) -> bool:
    """Whether attention.c takes this cache ([blocks, block_size, kv_heads, head_dim]) on AMX
    tiles: bf16 or fp8, head_dim a multiple of 32 up to 256, blocks of a multiple of 16."""
    _, block_size, _, dim = cache.shape
    tiled = cache.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
    return tiles and tiled and dim % 32 == 0 and dim <= 256 and block_size % 16 == 0


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    tiles: bool | None = None,
) -> torch.Tensor:
    """Prompt chunks' causal attention (`reference.paged_prefill_attention`'s contract): as
    rows (`prefill_rows`) where the cache is on AMX tiles or the chunk has a window, soft cap
    or sinks (which leave SDPA for masked matmuls over every padded key); otherwise the
    reference's. Figures: docs/benchmarks.md, "Prompt tokens as attention rows"."""
    tiles = cpu_native.amx_tiles() if tiles is None else tiles
    if on_tiles(k_cache, tiles) or window or softcap or sinks is not None:
        return prefill_rows(query, k_cache, v_cache, plan, scale, window, softcap, sinks, tiles)
    return reference.paged_prefill_attention(query, k_cache, v_cache, plan, scale)


def prefill_rows(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    tiles: bool | None = None,
) -> torch.Tensor:
    """Each prompt token a row of `paged_decode_attention`, attending its sequence up to
    itself, as the fused layers run them: a token's bits whatever route computes it."""
    tokens, rows = query.shape[0], plan.block_tables.shape[0]
    ends = plan.query_start[1:]
    owner = torch.repeat_interleave(
        torch.arange(rows, device=query.device), ends - plan.query_start[:-1], output_size=tokens
    )
    # Token t of a row ending at `end` sits `end - t` tokens before the row's KV length.
    lens = plan.seq_lens[owner] - ends[owner] + torch.arange(tokens, device=query.device) + 1
    each = DecodePlan(plan.block_tables[owner], lens, k_cache.shape[1])
    return paged_decode_attention(
        query, k_cache, v_cache, each, scale, window, softcap, sinks, tiles=tiles
    )
