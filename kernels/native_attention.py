"""The CPU attention backend when the native kernels are built: decode attention reads the
paged cache in place (`kernels/native/attention.c`); KV writes and prefill are the torch
reference's, whose batched SDPA already does well on long chunks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_native
from kernels.reference import paged_prefill_attention, write_kv

__all__ = ["paged_decode_attention", "paged_prefill_attention", "plan_decode", "write_kv"]


@dataclass(slots=True, frozen=True)
class DecodePlan:
    block_tables: torch.Tensor  # [rows, width] int64, contiguous
    seq_lens: torch.Tensor  # [rows] int64
    block_size: int


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> DecodePlan:
    return DecodePlan(
        block_tables.to(torch.int64).contiguous(), seq_lens.to(torch.int64).contiguous(), block_size
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:
    """One float32 query token per row ([rows, heads, head_dim]) against its row's paged KV."""
    lib = cpu_native.library()
    assert lib is not None
    query = query.contiguous()
    rows, heads, dim = query.shape
    kv_heads = k_cache.shape[2]
    if dim % 8 or heads % kv_heads or k_cache.dtype != torch.float32:
        raise ValueError(
            "native decode attention needs a float32 cache and head_dim % 8 == 0, got "
            f"{k_cache.dtype} and {dim}"
        )
    out = torch.empty_like(query)
    status = lib.paged_decode_attention_f32(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        plan.block_tables.data_ptr(),
        plan.block_tables.shape[1],
        plan.seq_lens.data_ptr(),
        out.data_ptr(),
        rows,
        heads,
        kv_heads,
        dim,
        plan.block_size,
        scale,
    )
    if status:
        raise MemoryError("native decode attention could not allocate its scores")
    return out
