"""Speculative decoding's drafts by prompt lookup (vLLM's "ngram" method): a decoding row whose
last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) appeared earlier among
its own tokens drafts the tokens that followed their latest appearance. Text that repeats its
context (code edits, extraction, summaries that quote) drafts well; the executor's verification
keeps every answer what plain decoding gives."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from turnstile.scheduler_svc.running_batch import RunningBatch
from turnstile.shared.batch_table import within_rows
from turnstile.shared.protocol import PlanDrafts, pack_ids
from turnstile.shared.speculative import Speculation


@dataclass(slots=True)
class Drafts:
    """A step's drafts: row `slots[i]` verifies `counts[i]` drafted tokens, `tokens` holding
    them row after row."""

    slots: np.ndarray
    counts: np.ndarray
    tokens: np.ndarray

    def fit(self, rows: np.ndarray, scheduled: np.ndarray, room: int) -> Drafts | None:
        """The drafts the step's `room` (tokens left after its decodes and prompt chunks)
        holds, in row order, each added to its row's count in `scheduled` (of `rows`)."""
        kept = self._keep(np.clip(room - (np.cumsum(self.counts) - self.counts), 0, self.counts))
        if kept is not None:
            scheduled += kept.per_row(rows)
        return kept

    def only(self, rows: np.ndarray) -> Drafts | None:
        """The drafts of the rows still running once preemption chose its victims."""
        return self._keep(np.where(np.isin(self.slots, rows), self.counts, 0))

    def _keep(self, counts: np.ndarray) -> Drafts | None:
        """The first `counts[i]` drafts of each row; None if that is none at all."""
        keep = counts > 0
        if not keep.any():
            return None
        taken = self.tokens[within_rows(self.counts) < np.repeat(counts, self.counts)]
        return Drafts(self.slots[keep], counts[keep], taken)

    def message(self, batch: RunningBatch) -> PlanDrafts:
        """The drafts as a `BatchPlan` carries them."""
        return PlanDrafts(
            pack_ids(batch.req_ids[self.slots]), pack_ids(self.counts), pack_ids(self.tokens)
        )

    def per_row(self, rows: np.ndarray) -> np.ndarray:
        """How many drafts each of `rows` verifies (0 for a row without)."""
        order = np.argsort(rows)
        counts = np.zeros(len(rows), dtype=np.int64)
        counts[order[np.searchsorted(rows, self.slots, sorter=order)]] = self.counts
        return counts


class NgramDrafter:
    def __init__(self, speculation: Speculation) -> None:
        self.k = speculation.num_speculative_tokens
        self.low = speculation.prompt_lookup_min
        self.high = speculation.prompt_lookup_max

    def propose(self, batch: RunningBatch, rows: np.ndarray) -> Drafts | None:
        """Drafts for the rows that decode this step and may speculate (`batch.speculates`),
        none past a row's length."""
        room = batch.stop_len[rows] - batch.num_tokens[rows] - 1
        decoding = batch.num_tokens[rows] - batch.num_computed[rows] == 1
        eligible = np.flatnonzero(batch.speculates[rows] & decoding & (room > 0))
        slots, counts, drafted = [], [], []
        for position in eligible.tolist():
            slot = int(rows[position])
            limit = min(self.k, int(room[position]))
            draft = lookup(batch.known_tokens(slot), limit, self.low, self.high)
            if len(draft):
                slots.append(slot)
                counts.append(len(draft))
                drafted.append(draft)
        if not slots:
            return None
        return Drafts(np.array(slots), np.array(counts), np.concatenate(drafted))


def lookup(tokens: np.ndarray, k: int, low: int, high: int) -> np.ndarray:
    """Up to `k` tokens that followed the latest earlier appearance of the longest suffix of
    `tokens` (from `high` tokens down to `low`); none if no such suffix appeared."""
    last = len(tokens) - 1
    if last < low:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # where a match's last token lies
    length = np.ones(len(ends), dtype=np.int64)
    alive = ends >= 0
    for back in range(1, high):
        if not alive.any():
            break
        earlier = ends - back
        alive &= earlier >= 0
        alive[alive] = tokens[earlier[alive]] == tokens[last - back]
        length += alive
    if not len(ends) or length.max() < low:
        return tokens[:0]
    end = ends[np.flatnonzero(length == length.max())[-1]]
    return tokens[end + 1 : end + 1 + k]
