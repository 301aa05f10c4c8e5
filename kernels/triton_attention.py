"""Triton kernels for CUDA: KV-cache write, paged decode attention, and prefill / chunked-prefill
attention over paged KV. Same arguments and results as `kernels.reference`.

Scores and the softmax run in fp32 whatever the cache dtype. A bf16 or fp16 cache feeds the
prefill's `tl.dot` in its own dtype (tensor cores, fp32 accumulation); an fp32 cache, and every
cache under TRITON_INTERPRET (whose bf16 dots are wrong), gets IEEE fp32 dots: tf32 would break
parity. Block and token offsets are int64: block * stride overflows int32 on large caches.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from turnstile.kernels.reference import DecodePlan, PrefillPlan

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def write_kv_kernel(
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    stride_key,
    stride_value,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot >= 0:  # -1: a padding row of a CUDA graph, which writes nothing
        offsets = tl.arange(0, ROW_PAD)
        mask = offsets < ROW
        k = tl.load(key + token * stride_key + offsets, mask=mask)
        v = tl.load(value + token * stride_value + offsets, mask=mask)
        tl.store(k_cache + slot * ROW + offsets, k, mask=mask)
        tl.store(v_cache + slot * ROW + offsets, v, mask=mask)


@triton.jit
def _soft_capped(scores, SOFTCAP: tl.constexpr):
    """Gemma 2's softcap * tanh(score / softcap); tanh as 2 sigmoid(2x) - 1, which every
    Triton backend (the interpreter's too) has."""
    if SOFTCAP > 0:
        scores = SOFTCAP * (2.0 * tl.sigmoid(scores * (2.0 / SOFTCAP)) - 1.0)
    return scores


@triton.jit
def paged_decode_kernel(
    out,
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    window,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_table,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SOFTCAP: tl.constexpr,
    sinks,
    SINKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    kv_head = (head // GROUP).to(tl.int64)
    seq_len = tl.load(seq_lens + row)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(query + row * stride_q_token + head * stride_q_head + dims, mask=dim_ok, other=0.0)
    q = q.to(tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    running_max = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([DIM_PAD], tl.float32)
    # The first key seen: a window's first, which no block before it holds.
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    for index in range(first // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables + row * stride_table + index).to(tl.int64)
        key_pos = index * BLOCK_SIZE + slots
        visible = (key_pos < seq_len) & (key_pos >= first)
        offsets = (
            block * stride_c_block
            + slots[:, None] * stride_c_slot
            + kv_head * stride_c_head
            + dims[None, :]
        )
        mask = visible[:, None] & dim_ok[None, :]
        k = tl.load(k_cache + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache + offsets, mask=mask, other=0.0).to(tl.float32)
        scores = _soft_capped(tl.sum(k * q[None, :], axis=1) * scale, SOFTCAP)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        weights = tl.exp(scores - new_max)
        rescale = tl.exp(running_max - new_max)
        acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
        total = total * rescale + tl.sum(weights, axis=0)
        running_max = new_max
    if SINKS:  # gpt-oss: one more logit in the softmax's sum, no value
        total += tl.exp(tl.load(sinks + head).to(tl.float32) - running_max)
    result = (acc / total).to(out.dtype.element_ty)
    tl.store(out + row * stride_o_token + head * stride_o_head + dims, result, mask=dim_ok)


@triton.jit
def paged_prefill_kernel(
    out,
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    window,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_table,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    SOFTCAP: tl.constexpr,
    sinks,
    SINKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kv_head = (head // GROUP).to(tl.int64)
    first_token = tl.load(query_start_loc + row).to(tl.int64)
    query_len = tl.load(query_start_loc + row + 1).to(tl.int64) - first_token
    if tile * BLOCK_M < query_len:
        seq_len = tl.load(seq_lens + row).to(tl.int64)
        context = seq_len - query_len
        index_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = index_m < query_len
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        tokens = first_token + index_m
        q = tl.load(
            query + tokens[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if not TENSOR_CORES:
            q = q.to(tl.float32)
        query_pos = context + index_m
        last_pos = context + tl.minimum(query_len, (tile + 1) * BLOCK_M) - 1
        slots = tl.arange(0, BLOCK_SIZE)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        # The tile's first query sees back to here, later ones less far.
        first = tl.where(window > 0, tl.maximum(context + tile * BLOCK_M - window + 1, 0), 0)
        for index in range(first // BLOCK_SIZE, tl.cdiv(last_pos + 1, BLOCK_SIZE)):
            block = tl.load(block_tables + row * stride_table + index).to(tl.int64)
            key_pos = index * BLOCK_SIZE + slots
            offsets = (
                block * stride_c_block
                + slots[:, None] * stride_c_slot
                + kv_head * stride_c_head
                + dims[None, :]
            )
            mask = (key_pos < seq_len)[:, None] & dim_ok[None, :]
            k = tl.load(k_cache + offsets, mask=mask, other=0.0)
            v = tl.load(v_cache + offsets, mask=mask, other=0.0)
            if TENSOR_CORES:
                scores = tl.dot(q, tl.trans(k)) * scale
            else:
                k, v = k.to(tl.float32), v.to(tl.float32)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            scores = _soft_capped(scores, SOFTCAP)
            visible = (key_pos[None, :] <= query_pos[:, None]) & (
                (window <= 0) | (key_pos[None, :] > query_pos[:, None] - window)
            )
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            # A row that has seen no key yet (its window starts in a later block) keeps max
            # -inf: shift by 0 there, so its weights are 0 rather than exp(nan).
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            weights = tl.exp(scores - shift[:, None])
            rescale = tl.exp(running_max - shift)
            if TENSOR_CORES:
                acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
            else:
                acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision="ieee")
            total = total * rescale + tl.sum(weights, axis=1)
            running_max = new_max
        if SINKS:
            total += tl.exp(tl.load(sinks + head).to(tl.float32) - running_max)
        result = (acc / total[:, None]).to(out.dtype.element_ty)
        tl.store(
            out + tokens[:, None] * stride_o_token + head * stride_o_head + dims[None, :],
            result,
            mask=row_ok[:, None] & dim_ok[None, :],
        )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    row = k_cache.shape[2] * k_cache.shape[3]
    write_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
        ROW=row, ROW_PAD=triton.next_power_of_2(row),
    )  # fmt: skip


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    return cache.stride(0), cache.stride(1), cache.stride(2)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sinks` [heads]: a logit a head in its softmax's sum (gpt-oss)."""
    block_tables, seq_lens = plan.block_tables, plan.seq_lens
    rows, heads, dim = query.shape
    out = torch.empty_like(query)
    paged_decode_kernel[(rows, heads)](
        out, query, k_cache, v_cache, block_tables, seq_lens, scale, window,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *_cache_strides(k_cache),
        GROUP=heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=dim,
        DIM_PAD=triton.next_power_of_2(dim), SOFTCAP=softcap,
        sinks=query if sinks is None else sinks, SINKS=sinks is not None,
    )  # fmt: skip
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    block_m: int = 16,
) -> torch.Tensor:
    """The grid needs `plan.longest`, which the host knows: no sync."""
    _, heads, dim = query.shape
    block_tables, seq_lens, query_start_loc = plan.block_tables, plan.seq_lens, plan.query_start
    rows, longest = block_tables.shape[0], plan.longest
    out = torch.empty_like(query)
    paged_prefill_kernel[(rows, heads, triton.cdiv(longest, block_m))](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *_cache_strides(k_cache),
        GROUP=heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m,
        HEAD_DIM=dim, DIM_PAD=triton.next_power_of_2(dim),
        TENSOR_CORES=k_cache.dtype != torch.float32 and not _INTERPRETED, SOFTCAP=softcap,
        sinks=query if sinks is None else sinks, SINKS=sinks is not None,
    )  # fmt: skip
    return out
