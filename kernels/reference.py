"""Paged attention and KV-cache writes in plain torch: the CPU production path and the
reference the Triton kernels are tested against.

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
    """Store new tokens' K and V ([tokens, kv_heads, head_dim]) at their flat slots."""
    heads, dim = k_cache.shape[2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, value)


def _gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, kv_heads, blocks * block_size, head_dim] for the rows' block ids, row-major."""
    num_blocks, _, heads, dim = cache.shape
    # index_select over flat rows: several times faster than advanced indexing on the CPU.
    gathered = torch.index_select(cache.view(num_blocks, -1), 0, block_ids)
    return gathered.view(rows, -1, heads, dim).transpose(1, 2)


@dataclass(slots=True, frozen=True)
class DecodePlan:
    """What every layer's decode attention needs, built once a step rather than per layer:
    the rows' block ids as one flat index, and which gathered slots each row may see."""

    block_ids: torch.Tensor  # [rows * blocks]
    rows: int
    visible: torch.Tensor  # [rows, 1, 1, blocks * block_size]


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> DecodePlan:
    rows, width = block_tables.shape
    positions = torch.arange(width * block_size, device=block_tables.device)
    visible = (positions[None, :] < seq_lens[:, None])[:, None, None, :]
    return DecodePlan(block_tables.reshape(-1), rows, visible)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:
    """One query token per row ([rows, heads, head_dim]) against its row's whole paged KV."""
    keys = _gather_kv(k_cache, plan.block_ids, plan.rows)
    values = _gather_kv(v_cache, plan.block_ids, plan.rows)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), keys, values, attn_mask=plan.visible, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each row's new tokens (a prompt chunk, possibly after a cached or
    earlier-computed prefix) against the row's paged KV, new tokens included.

    `query` is [tokens, heads, head_dim], rows concatenated; `query_start_loc` has rows + 1
    offsets. Rows are padded to the longest chunk, so batch long chunks with each other and
    decodes separately (`paged_decode_attention`).
    """
    rows = block_tables.shape[0]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    longest = int(query_lens.max())
    index = torch.arange(longest, device=query.device)
    valid = index[None, :] < query_lens[:, None]
    token = (query_start_loc[:-1, None] + index[None, :]).clamp(max=query.shape[0] - 1)
    padded = query[token].transpose(1, 2)  # [rows, heads, longest, dim]
    block_ids = block_tables.reshape(-1)
    keys = _gather_kv(k_cache, block_ids, rows)
    values = _gather_kv(v_cache, block_ids, rows)
    # Query i of a row sits at position seq_len - query_len + i and sees keys up to there.
    query_pos = (seq_lens - query_lens)[:, None] + index[None, :]
    key_pos = torch.arange(keys.shape[2], device=query.device)
    visible = key_pos[None, None, :] <= query_pos[:, :, None]
    out = F.scaled_dot_product_attention(
        padded, keys, values, attn_mask=visible[:, None], scale=scale, enable_gqa=True
    )
    out = out.transpose(1, 2)  # [rows, longest, heads, dim]
    return out[valid].reshape(-1, *query.shape[1:]) if rows else query.new_empty(query.shape)
