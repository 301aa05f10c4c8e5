"""Paged attention as the model's layers call it: the kernels a backend brings
(`PagedAttention`), and one step's layout over them (`AttentionBatch`), built once a step from
host-known shapes and reused by every layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from turnstile.kernels.reference import DecodePlan, PrefillPlan

Tensor = torch.Tensor


@dataclass(slots=True, frozen=True)
class PagedAttention:
    """One kernel set (`kernels/`): KV-cache writes, and attention over the paged cache."""

    write_kv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]  # k, v, caches, slots
    # query, caches, plan, scale, sliding window (0: none), score soft-cap (0: none), each head's
    # sink logit (None: none)
    decode: Callable[[Tensor, Tensor, Tensor, DecodePlan, float, int, float, Tensor | None], Tensor]
    prefill: Callable[
        [Tensor, Tensor, Tensor, PrefillPlan, float, int, float, Tensor | None], Tensor
    ]
    # Built once a step for every layer's `decode`; most kernels read the tables as they are.
    plan_decode: Callable[[Tensor, Tensor, int], DecodePlan] = DecodePlan


@dataclass(slots=True, frozen=True)
class AttentionBatch:
    """A step's tokens split into decode rows (one new token) and prefill rows (several), each
    kind attended in one batched call. `decode_tokens` and `prefill_tokens` index the step's
    tokens of each kind; an absent kind is None, and a kind alone needs no index."""

    kernels: PagedAttention
    slot_mapping: Tensor  # KV slot of each token
    decode: DecodePlan | None
    decode_tokens: Tensor | None
    prefill: PrefillPlan | None
    prefill_tokens: Tensor | None

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: Tensor | None = None,
    ) -> Tensor:
        kernels = self.kernels
        kernels.write_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if self.prefill is None:
            assert self.decode is not None
            return kernels.decode(q, k_cache, v_cache, self.decode, scale, window, softcap, sinks)
        if self.decode is None:
            return kernels.prefill(q, k_cache, v_cache, self.prefill, scale, window, softcap, sinks)
        assert self.decode_tokens is not None and self.prefill_tokens is not None
        out = torch.empty_like(q)
        out[self.decode_tokens] = kernels.decode(
            q[self.decode_tokens], k_cache, v_cache, self.decode, scale, window, softcap, sinks
        )
        out[self.prefill_tokens] = kernels.prefill(
            q[self.prefill_tokens], k_cache, v_cache, self.prefill, scale, window, softcap, sinks
        )
        return out
