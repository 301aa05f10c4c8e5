"""The Triton kernels as torch custom ops (`torch.ops.turnstile.*`), each with a fake
implementation: FakeTensor, the `meta` device and `torch.compile` trace a whole step through
them without running a kernel, and CUDA graphs capture them like any op. `decode` and `prefill`
take the plans the other kernel sets take (a custom op takes tensors and numbers only)."""

from __future__ import annotations

import torch

from turnstile.kernels import triton_attention
from turnstile.kernels.reference import DecodePlan, PrefillPlan


@torch.library.custom_op("turnstile::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    triton_attention.write_kv(key, value, k_cache, v_cache, slot_mapping)


@torch.library.custom_op("turnstile::paged_decode", mutates_args=())
def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    plan = DecodePlan(block_tables, seq_lens, block_size)
    return triton_attention.paged_decode_attention(
        query, k_cache, v_cache, plan, scale, window, softcap, sinks
    )


@torch.library.custom_op("turnstile::paged_prefill", mutates_args=())
def paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    longest: int,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    plan = PrefillPlan(block_tables, seq_lens, query_start_loc, longest)
    return triton_attention.paged_prefill_attention(
        query, k_cache, v_cache, plan, scale, window, softcap, sinks
    )


def decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    tables, lens, size = plan.block_tables, plan.seq_lens, plan.block_size
    return paged_decode(query, k_cache, v_cache, tables, lens, size, scale, window, softcap, sinks)


def prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    tables, lens, start = plan.block_tables, plan.seq_lens, plan.query_start
    return paged_prefill(
        query, k_cache, v_cache, tables, lens, start, scale, plan.longest, window, softcap, sinks
    )


def _on_one_device(*tensors: torch.Tensor | None) -> None:
    """What a kernel launch would refuse: a tensor on another device than the others."""
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise RuntimeError(f"a Triton kernel was given tensors on {sorted(map(str, devices))}")


def _like_query(query: torch.Tensor, *rest: torch.Tensor | None) -> torch.Tensor:
    _on_one_device(query, *rest)
    return torch.empty_like(query)


def _nothing(*tensors: torch.Tensor) -> None:
    _on_one_device(*tensors)


write_kv.register_fake(_nothing)
paged_decode.register_fake(_like_query)
paged_prefill.register_fake(_like_query)
