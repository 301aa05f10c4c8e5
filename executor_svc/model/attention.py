"""Paged attention as the model's layers call it: the kernels a backend brings
(`PagedAttention`), and one step's layout over them (`AttentionBatch`), built once a step from
host-known shapes and reused by every layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kernels.reference import DecodePlan


class PagedAttention(ABC):
    """KV-cache writes and attention over a paged cache (layout in `kernels/reference.py`)."""

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def plan_decode(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> DecodePlan:
        """Built once a step for every layer's `decode`; most kernels read the tables as they
        are."""
        return DecodePlan(block_tables, seq_lens, block_size)

    @abstractmethod
    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlan,
        scale: float,
    ) -> torch.Tensor:
        """One query token per row ([rows, heads, head_dim]) against its row's paged KV."""

    @abstractmethod
    def prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: PrefillPlan,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of each row's new tokens ([tokens, heads, head_dim], rows
        concatenated) against the row's paged KV, new tokens included."""


@dataclass(slots=True, frozen=True)
class PrefillPlan:
    block_tables: torch.Tensor  # [rows, width]
    seq_lens: torch.Tensor  # [rows]: KV length once this step's tokens are written
    query_start: torch.Tensor  # [rows + 1]: offsets of each row's tokens
    longest: int  # the longest row's token count, known to the host


@dataclass(slots=True, frozen=True)
class AttentionBatch:
    """A step's tokens split into decode rows (one new token) and prefill rows (several), each
    kind attended in one batched call. `decode_tokens` and `prefill_tokens` index the step's
    tokens of each kind; an absent kind is None, and a kind alone needs no index."""

    kernels: PagedAttention
    slot_mapping: torch.Tensor  # KV slot of each token
    decode: DecodePlan | None
    decode_tokens: torch.Tensor | None
    prefill: PrefillPlan | None
    prefill_tokens: torch.Tensor | None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        kernels = self.kernels
        kernels.write_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if self.prefill is None:
            assert self.decode is not None
            return kernels.decode(q, k_cache, v_cache, self.decode, scale)
        if self.decode is None:
            return kernels.prefill(q, k_cache, v_cache, self.prefill, scale)
        assert self.decode_tokens is not None and self.prefill_tokens is not None
        out = torch.empty_like(q)
        out[self.decode_tokens] = kernels.decode(
            q[self.decode_tokens], k_cache, v_cache, self.decode, scale
        )
        out[self.prefill_tokens] = kernels.prefill(
            q[self.prefill_tokens], k_cache, v_cache, self.prefill, scale
        )
        return out
