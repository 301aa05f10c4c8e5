"""One step's attention layout: which tokens are decodes and which are prefill chunks, built
once per step and reused by every layer."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

# A step whose prefill chunks are short runs every token as a row of its own through the fused
# decode layers: each token attends its sequence up to itself, as a decode does, and the
# weights are read once for the whole step. Ad hoc (median of 5, bf16 weights), one fresh
# prompt alone: 16 tokens 37 against 70 ms through the torch layers, 128 tokens 225 against 310,
# 512 tokens 1,081 against 1,136. A token reads its whole context, though, where the batched
# prefill reads it once per chunk: after a cached 1,024-token prefix, 32 new tokens took 143
# against 163 ms, 128 took 520 against 480. Hence the two limits.
SHORT_PREFILL_TOKENS = 512
SHORT_PREFILL_CONTEXT = 32768  # summed over the prefill tokens: the positions they attend


@dataclass(slots=True)
class AttentionBatch:
    """Rows are split into decodes (one new token) and prefills (several), each attended in
    one batched call. Token tensors are in row order; `decode_tokens` / `prefill_tokens`
    index the tokens of each group."""

    slot_mapping: torch.Tensor
    decode_tokens: torch.Tensor
    decode_plan: object  # the backend's `plan_decode`, shared by every layer
    # Every token as a row of its own, attending its sequence up to itself: the decode plan
    # when every row decodes; for prefill tokens only when they are few (`SHORT_PREFILL_TOKENS`).
    token_plan: object | None
    prefill_tokens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_query_start: torch.Tensor
    all_decode: bool
    kernels: ModuleType

    @classmethod
    def build(
        cls,
        kernels: ModuleType,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        tokens_as_rows: bool = False,
    ) -> AttentionBatch:
        """`tokens_as_rows`: whether the model can take `token_plan` (see above)."""
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        is_decode = query_lens == 1
        decode_rows = is_decode.nonzero().squeeze(1)
        prefill_rows = (~is_decode).nonzero().squeeze(1)
        prefill_lens = query_lens[prefill_rows]
        prefill_start = torch.zeros(len(prefill_rows) + 1, dtype=torch.int64)
        torch.cumsum(prefill_lens, 0, out=prefill_start[1:])
        starts = query_start_loc[prefill_rows]
        prefill_tokens = torch.repeat_interleave(starts - prefill_start[:-1], prefill_lens)
        prefill_tokens += torch.arange(int(prefill_start[-1]), dtype=torch.int64)
        decode_plan = kernels.plan_decode(
            block_tables[decode_rows], seq_lens[decode_rows], block_size
        )
        token_plan = decode_plan if len(prefill_rows) == 0 else None
        if tokens_as_rows and 0 < len(prefill_tokens) <= SHORT_PREFILL_TOKENS:
            context = int(positions[prefill_tokens].sum()) + len(prefill_tokens)
            if context <= SHORT_PREFILL_CONTEXT:
                token_rows = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
                seq_lens_per_token = positions.to(torch.int64) + 1
                token_plan = kernels.plan_decode(
                    block_tables[token_rows], seq_lens_per_token, block_size
                )
        return cls(
            slot_mapping=slot_mapping,
            decode_tokens=query_start_loc[decode_rows],
            decode_plan=decode_plan,
            token_plan=token_plan,
            prefill_tokens=prefill_tokens,
            prefill_block_tables=block_tables[prefill_rows],
            prefill_seq_lens=seq_lens[prefill_rows],
            prefill_query_start=prefill_start,
            all_decode=len(prefill_rows) == 0,
            kernels=kernels,
        )

    def prefill_only(self) -> AttentionBatch:
        """The prefill rows alone, their tokens numbered from 0 in `prefill_tokens` order:
        for a step whose decode rows run elsewhere."""
        return AttentionBatch(
            slot_mapping=self.slot_mapping[self.prefill_tokens],
            decode_tokens=self.decode_tokens[:0],
            decode_plan=self.decode_plan,
            token_plan=None,
            prefill_tokens=torch.arange(len(self.prefill_tokens)),
            prefill_block_tables=self.prefill_block_tables,
            prefill_seq_lens=self.prefill_seq_lens,
            prefill_query_start=self.prefill_query_start,
            all_decode=False,
            kernels=self.kernels,
        )

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        self.kernels.write_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if self.all_decode:
            return self.kernels.paged_decode_attention(q, k_cache, v_cache, self.decode_plan, scale)
        out = torch.empty_like(q)
        if len(self.decode_tokens):
            out[self.decode_tokens] = self.kernels.paged_decode_attention(
                q[self.decode_tokens],
                k_cache,
                v_cache,
                self.decode_plan,
                scale,
            )
        out[self.prefill_tokens] = self.kernels.paged_prefill_attention(
            q[self.prefill_tokens],
            k_cache,
            v_cache,
            self.prefill_block_tables,
            self.prefill_seq_lens,
            self.prefill_query_start,
            scale,
        )
        return out
