"""Paged attention and KV-cache writes in plain torch: the reference every other kernel is
tested against, and the CPU's attention where the native kernels cannot run.

KV cache layout, per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V.
Token t of a sequence lives in block `block_table[t // block_size]` at offset
`t % block_size`; its flat slot is `block * block_size + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new tokens' K and V ([tokens, kv_heads, head_dim]) at their flat slots, in the
    cache's dtype: an fp8 value beyond the format's largest saturates to it, as vLLM's."""
    heads, dim = k_cache.shape[2:]
    for cache, new in ((k_cache, key), (v_cache, value)):
        if cache.dtype.itemsize == 1:  # fp8, copied as bytes: the CPU has no fp8 index_copy_
            largest = torch.finfo(cache.dtype).max
            new = new.clamp(-largest, largest).to(cache.dtype).view(torch.uint8)
            cache = cache.view(torch.uint8)
        cache.view(-1, heads, dim).index_copy_(0, slot_mapping, new.to(cache.dtype))


def _gather_kv(
    cache: torch.Tensor, block_ids: torch.Tensor, rows: int, dtype: torch.dtype
) -> torch.Tensor:
    """[rows, kv_heads, blocks * block_size, head_dim] for the rows' block ids, row-major, in
    `dtype` (the queries')."""
    num_blocks, _, heads, dim = cache.shape
    # index_select over flat rows: several times faster than advanced indexing on the CPU.
    gathered = torch.index_select(cache.view(num_blocks, -1), 0, block_ids).to(dtype)
    return gathered.view(rows, -1, heads, dim).transpose(1, 2)


@dataclass(slots=True, frozen=True)
class DecodePlan:
    """What every layer's decode attention needs, built once a step rather than per layer.
    All three kernel sets read the tables; this one also keeps which gathered slots each row
    may see."""

    block_tables: torch.Tensor  # [rows, width] int64, contiguous
    seq_lens: torch.Tensor  # [rows] int64
    block_size: int
    visible: torch.Tensor | None = None  # [rows, 1, 1, width * block_size], this module's


@dataclass(slots=True, frozen=True)
class PrefillPlan:
    """The rows of a step that compute several tokens (prompt chunks)."""

    block_tables: torch.Tensor  # [rows, width]
    seq_lens: torch.Tensor  # [rows]: KV length once this step's tokens are written
    query_start: torch.Tensor  # [rows + 1]: offsets of each row's tokens
    longest: int  # the longest row's token count, known to the host
    from_start: bool = False  # every row's chunk starts at position 0 (no prefix), on the host


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> DecodePlan:
    width = block_tables.shape[1]
    positions = torch.arange(width * block_size, device=block_tables.device)
    visible = (positions[None, :] < seq_lens[:, None])[:, None, None, :]
    return DecodePlan(block_tables, seq_lens, block_size, visible)


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of [rows, heads, queries, dim] over [rows, kv_heads, keys, dim] where
    `visible`. With `softcap` (Gemma 2), each scaled score s becomes softcap * tanh(s /
    softcap) before the softmax, as transformers computes it; with `sinks` [heads] (gpt-oss),
    each head's softmax has one more logit, whose value is not read. SDPA has neither step."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=visible, scale=scale, enable_gqa=True
        )
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = query @ keys.transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return scores.softmax(dim=-1) @ values
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    return torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1] @ values


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
    """One query token per row ([rows, heads, head_dim]) against its row's paged KV: all of
    it, or with a `window` its last `window` tokens; scores soft-capped where `softcap`, and
    `sinks` in each head's softmax (`_attend`)."""
    rows = plan.block_tables.shape[0]
    keys = _gather_kv(k_cache, plan.block_tables.reshape(-1), rows, query.dtype)
    values = _gather_kv(v_cache, plan.block_tables.reshape(-1), rows, query.dtype)
    visible = plan.visible
    if window:
        positions = torch.arange(keys.shape[2], device=query.device)
        visible = visible & (positions >= (plan.seq_lens - window)[:, None])[:, None, None, :]
    return _attend(query.unsqueeze(2), keys, values, visible, scale, softcap, sinks).squeeze(2)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each row's new tokens (a prompt chunk, possibly after a cached or
    earlier-computed prefix) against the row's paged KV, new tokens included; with a `window`,
    each query sees itself and the `window - 1` keys before it.

    `query` is [tokens, heads, head_dim], rows concatenated. Rows are padded to the longest,
    so batch long chunks with each other and decodes separately (`paged_decode_attention`).
    """
    block_tables, seq_lens, query_start_loc = plan.block_tables, plan.seq_lens, plan.query_start
    longest, rows = plan.longest, plan.block_tables.shape[0]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    index = torch.arange(longest, device=query.device)
    token = (query_start_loc[:-1, None] + index[None, :]).clamp(max=query.shape[0] - 1)
    padded = query[token].transpose(1, 2)  # [rows, heads, longest, dim]
    block_ids = block_tables.reshape(-1)
    keys = _gather_kv(k_cache, block_ids, rows, query.dtype)
    values = _gather_kv(v_cache, block_ids, rows, query.dtype)
    if (
        plan.from_start
        and not window
        and not softcap
        and sinks is None
        and query.device.type == "cpu"
    ):
        # Query i sees keys 0..i in every row: SDPA's own causal mask, which skips the masked
        # half where a mask tensor does not (half the time: docs/benchmarks.md). On the CPU
        # only, where it is top-left aligned for more keys than queries, as here.
        out = F.scaled_dot_product_attention(
            padded, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        # Query i of a row sits at position seq_len - query_len + i and sees keys up to there.
        query_pos = (seq_lens - query_lens)[:, None] + index[None, :]
        key_pos = torch.arange(keys.shape[2], device=query.device)
        visible = key_pos[None, None, :] <= query_pos[:, :, None]
        if window:
            visible &= key_pos[None, None, :] > query_pos[:, :, None] - window
        out = _attend(padded, keys, values, visible[:, None], scale, softcap, sinks)
    out = out.transpose(1, 2).reshape(rows * longest, *query.shape[1:])
    # Each token's place among the padded rows, by shapes the host knows: no device sync.
    tokens = query.shape[0]
    owner = torch.repeat_interleave(
        torch.arange(rows, device=query.device), query_lens, output_size=tokens
    )
    place = owner * longest + torch.arange(tokens, device=query.device) - query_start_loc[owner]
    return out[place]
