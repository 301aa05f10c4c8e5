"""Decode attention on the CPU, reading the paged cache in place (`kernels/native/attention.c`,
which the fused layers also call for prompt tokens run as rows). KV writes and long prefill
chunks stay the torch reference's, whose batched SDPA does well on them."""

from __future__ import annotations

import torch

from turnstile.kernels import cpu_native
from turnstile.kernels.reference import DecodePlan

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
