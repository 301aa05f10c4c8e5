"""Plain torch on any device: the reference the other backends are tested against, and the
CPU's backend where the native kernels cannot run."""

from __future__ import annotations

import torch

from executor_svc.backend import Backend
from executor_svc.cpu_runtime import native_bf16_matmul
from executor_svc.model.attention import PagedAttention, PrefillPlan
from kernels import reference
from kernels.reference import DecodePlan


class TorchAttention(PagedAttention):
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def plan_decode(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> DecodePlan:
        return reference.plan_decode(block_tables, seq_lens, block_size)

    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlan,
        scale: float,
    ) -> torch.Tensor:
        return reference.paged_decode_attention(query, k_cache, v_cache, plan, scale)

    def prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: PrefillPlan,
        scale: float,
    ) -> torch.Tensor:
        return reference.paged_prefill_attention(
            query, k_cache, v_cache, plan.block_tables, plan.seq_lens, plan.query_start, scale,
            plan.longest,
        )  # fmt: skip


class TorchReferenceBackend(Backend):
    name = "torch"
    _attention = TorchAttention()

    @property
    def attention(self) -> PagedAttention:
        return self._attention

    def default_dtype(self) -> str:
        """bfloat16 only where torch multiplies it in hardware."""
        return "bfloat16" if native_bf16_matmul(self.device) else "float32"
