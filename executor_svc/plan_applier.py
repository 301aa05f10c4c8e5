"""Rebuilds the running batch from diff plans and turns each step into flat model inputs.

Torch-free on purpose: the simulated executor and the tests use it as it is, and the model
runner only wraps the arrays it returns in tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from turnstile.shared.batch_table import BatchTable, cdiv, spread
from turnstile.shared.protocol import BatchPlan, SamplingParams, adjusts_logits, unpack_ids


class PlanError(ValueError):
    """A plan that does not fit this executor's batch: lost, reordered or corrupt."""


@dataclass(slots=True)
class StepInputs:
    rows: np.ndarray  # slots computing tokens this step, in row order
    input_ids: np.ndarray  # one entry per computed token, rows concatenated
    positions: np.ndarray
    slot_mapping: np.ndarray  # KV cache slot (block * block_size + offset) of each token
    query_start_loc: np.ndarray  # len(rows) + 1 offsets into the token arrays
    seq_lens: np.ndarray  # KV length of each row once this step's tokens are written
    block_tables: np.ndarray  # [len(rows), blocks of the longest row]
    logits_indices: np.ndarray  # token whose logits are sampled, one per sampled position
    sample_rows: np.ndarray  # slots that sample a token, in row order
    # Speculative decoding: positions each sampling row samples (1 + its drafts), where any
    # row has drafts; each drafted token's position samples the token after it.
    sample_counts: np.ndarray | None = None
    # The tokens of rows that run a LoRA adapter, grouped by adapter: (slot, start, end) of
    # `lora_tokens` each; none without such rows.
    lora_tokens: np.ndarray | None = None
    lora_segments: tuple[tuple[int, int, int], ...] = ()
    # Each token's type (0 or 1: `SamplingParams.second_text`), where a row is an encoder's pair.
    token_types: np.ndarray | None = None


EMPTY: Mapping[int, int] = MappingProxyType({})
HOLE = -1  # a token sampled by a step still running: known on the device only


@dataclass(slots=True, frozen=True)
class Verified:
    """A step with drafts, its tokens checked against them: which of the sampled positions
    stand (`kept`: the drafts that matched, then the token after them), how many each row
    keeps, and each row's last."""

    kept: np.ndarray
    counts: np.ndarray
    last: np.ndarray


@dataclass(slots=True, frozen=True)
class Reserved:
    """The tokens a step samples, counted before they are known: slot, index, request."""

    rows: np.ndarray
    at: np.ndarray
    req_ids: np.ndarray


class PlanApplier:
    def __init__(self, capacity: int, max_model_len: int, block_size: int) -> None:
        self.batch = BatchTable(capacity, max_model_len, block_size)
        self.sampling: list[SamplingParams | None] = [None] * capacity
        self.adjusts = np.zeros(capacity, dtype=bool)  # rows with logits adjustments
        self.lora = np.zeros(capacity, dtype=np.int32)  # each row's adapter (0: none)
        self.second_text = np.full(capacity, -1, dtype=np.int64)  # each row's, -1: one text
        self.wants_prompt_logprobs = False  # whether any request so far asked for them
        self.step = 0
        self._sample_rows = np.empty(0, dtype=np.int64)
        self.drafted: np.ndarray | None = None  # the last step's drafts per sampling row

    def apply(self, plan: BatchPlan, adapter_slots: Mapping[int, int] = EMPTY) -> StepInputs:
        """The plan onto the batch; `adapter_slots`: the slot of each joining request's LoRA
        adapter, by request id (`executor_svc/adapters.py`), none for the base model."""
        if plan.step != self.step + 1:
            raise PlanError(f"plan for step {plan.step}; expected step {self.step + 1}")
        batch = self.batch
        try:
            batch.remove(unpack_ids(plan.removed))
            for new in plan.new:
                slot = batch.add(
                    new.req_id,
                    unpack_ids(new.token_ids),
                    new.num_prompt_tokens,
                    new.num_computed,
                    unpack_ids(new.block_ids),
                )
                self.sampling[slot] = new.sampling
                self.adjusts[slot] = adjusts_logits(new.sampling)
                self.lora[slot] = adapter_slots.get(new.req_id, 0)
                self.second_text[slot] = new.sampling.second_text
                self.wants_prompt_logprobs |= new.sampling.prompt_logprobs is not None
            drafts = self._append_drafts(plan)
            rows = batch.order
            scheduled = np.ones(len(rows), dtype=np.int64)
            overrides = unpack_ids(plan.override_ids)
            new_block_ids = unpack_ids(plan.new_block_ids)
            if plan.new or len(overrides):
                if plan.new:
                    scheduled[len(rows) - len(plan.new) :] = [n.num_scheduled for n in plan.new]
                if len(overrides):
                    scheduled[batch.positions_of(overrides)] = unpack_ids(plan.override_counts)
                batch.extend_blocks(rows, batch.blocks_needed(rows, scheduled), new_block_ids)
            else:
                at_boundary = batch.decode_block_rows(rows)
                if len(at_boundary) != len(new_block_ids):
                    raise ValueError(f"{len(new_block_ids)} new blocks for {len(at_boundary)}")
                batch.append_blocks(at_boundary, new_block_ids)
        except (KeyError, ValueError, IndexError) as exc:
            raise PlanError(f"plan for step {plan.step} does not apply: {exc}") from exc
        self.step = plan.step
        return self._inputs(rows[scheduled > 0], scheduled[scheduled > 0], drafts)

    def _append_drafts(self, plan: BatchPlan) -> np.ndarray | None:
        """The plan's drafts after their rows' known tokens; returns the drafts per slot."""
        if plan.drafts is None:
            return None
        ids, tokens = unpack_ids(plan.drafts.req_ids), unpack_ids(plan.drafts.tokens)
        counts = unpack_ids(plan.drafts.counts).astype(np.int64)
        batch = self.batch
        slots = np.array([batch.slot_of[int(r)] for r in ids], dtype=np.int64)
        if len(counts) != len(ids) or int(counts.sum()) != len(tokens) or (counts < 1).any():
            raise ValueError("drafts whose counts do not fit their rows or tokens")
        batch.append_drafts(slots, counts, tokens)
        per_slot = np.zeros(batch.capacity, dtype=np.int64)
        per_slot[slots] = counts
        return per_slot

    def verify(self, reserved: Reserved, drafted: np.ndarray, sampled: np.ndarray) -> Verified:
        """A step's sampled positions against its drafts (`drafted`, per sampling row): a row
        keeps its drafts up to the first its model did not sample, then the token it sampled
        there. The batch keeps those tokens; the rest are written over as the row goes on."""
        per = drafted + 1
        starts = np.cumsum(per) - per
        counts = np.ones(len(per), dtype=np.int64)
        for i in np.flatnonzero(drafted).tolist():
            first = int(reserved.at[i] - drafted[i])
            slot, out = reserved.rows[i], sampled[starts[i] : starts[i] + per[i]]
            misses = out[:-1] != self.batch.tokens[slot, first : first + drafted[i]]
            counts[i] = (int(np.argmax(misses)) if misses.any() else int(drafted[i])) + 1
        last_kept = starts + counts - 1
        kept, last = spread(last_kept, counts), sampled[last_kept]
        self.fill(reserved, last)
        rows = np.flatnonzero(drafted)
        emitted = [sampled[starts[i] : starts[i] + counts[i]] for i in rows.tolist()]
        self.batch.keep_drafted(reserved.rows[rows], reserved.at[rows] - drafted[rows], emitted)
        return Verified(kept, counts, last)

    def drafts_before(self) -> np.ndarray | None:
        """For the last step's sampled positions, the drafted token each follows (-1 at a
        row's first), where rows have drafts; before `reserve`."""
        if self.drafted is None:
            return None
        per = self.drafted + 1
        found = np.full(int(per.sum()), -1, dtype=np.int64)
        starts = np.cumsum(per) - per
        for i in np.flatnonzero(self.drafted).tolist():
            slot, count = self._sample_rows[i], int(self.drafted[i])
            end = int(self.batch.num_tokens[slot])
            found[starts[i] + 1 : starts[i] + 1 + count] = self.batch.tokens[
                slot, end - count : end
            ]
        return found

    def commit(self, sampled: np.ndarray) -> None:
        """Record the tokens sampled for `StepInputs.sample_rows`; they are next step's inputs."""
        self.fill(self.reserve(), sampled)

    def reserve(self) -> Reserved:
        """Count the tokens the last step's rows sample before they are known (`HOLE`s), so
        the next step can be planned on the host while this one runs on the device."""
        rows = self._sample_rows
        at = self.batch.num_tokens[rows].copy()
        self.batch.append_tokens(rows, np.full(len(rows), HOLE, dtype=np.int32))
        return Reserved(rows, at, self.batch.req_ids[rows].copy())

    def fill(self, reserved: Reserved, sampled: np.ndarray) -> None:
        """The reserved tokens, once known, for the rows still held by the same requests."""
        kept = self.batch.req_ids[reserved.rows] == reserved.req_ids
        self.batch.tokens[reserved.rows[kept], reserved.at[kept]] = sampled[kept]

    def _inputs(
        self, rows: np.ndarray, counts: np.ndarray, drafts: np.ndarray | None = None
    ) -> StepInputs:
        batch = self.batch
        starts = batch.num_computed[rows]
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        owner = np.repeat(rows, counts)
        positions = np.repeat(starts - query_start_loc[:-1], counts) + np.arange(
            query_start_loc[-1], dtype=np.int64
        )
        block_size = batch.block_size
        slot_mapping = batch.block_table[owner, positions // block_size] * block_size + (
            positions % block_size
        )
        seq_lens = starts + counts
        width = int(cdiv(int(seq_lens.max()), block_size)) if len(rows) else 0
        batch.num_computed[rows] = seq_lens
        sampling = batch.samples(rows)
        self._sample_rows = rows[sampling]
        logits_indices = query_start_loc[1:][sampling] - 1
        self.drafted = None if drafts is None else drafts[self._sample_rows]
        if self.drafted is not None:
            logits_indices = spread(logits_indices, self.drafted + 1)
        inputs = StepInputs(
            rows=rows,
            input_ids=batch.tokens[owner, positions],
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=batch.block_table[rows, :width],
            logits_indices=logits_indices,
            sample_rows=self._sample_rows,
            sample_counts=None if self.drafted is None else self.drafted + 1,
        )
        if self.lora[rows].any():
            inputs.lora_tokens, inputs.lora_segments = _by_adapter(self.lora[owner])
        if (self.second_text[rows] >= 0).any():
            second = self.second_text[owner]
            inputs.token_types = ((second >= 0) & (positions >= second)).astype(np.int64)
        return inputs


def _by_adapter(adapters: np.ndarray) -> tuple[np.ndarray, tuple[tuple[int, int, int], ...]]:
    """The tokens that run an adapter, grouped by it, and each group's (adapter, start, end)."""
    order = np.argsort(adapters, kind="stable")
    order = order[adapters[order] > 0]
    slots, starts = np.unique(adapters[order], return_index=True)
    ends = [*starts[1:].tolist(), len(order)]
    return order, tuple(zip(slots.tolist(), starts.tolist(), ends, strict=True))
