"""A step sent and not yet answered: which rows sample in it and where each token goes.

Results come back in order, but by then a row may have left (ended, aborted, preempted) and
its slot gone to another request: the admission each row had when the step was planned tells
a late token from a live one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from turnstile.scheduler_svc.ngram_drafter import Drafts
from turnstile.scheduler_svc.running_batch import RunningBatch

_NONE = np.empty(0, dtype=np.int64)


@dataclass(slots=True)  # not frozen: one is made every step, and frozen init is slower
class StepInFlight:
    step: int
    slots: np.ndarray  # the rows that sample a token, in row order (the executor's order)
    admissions: np.ndarray  # which admission each of those rows was
    req_ids: np.ndarray
    index: np.ndarray  # where each sampled token goes in its row
    prefilled: np.ndarray  # rows that computed prompt chunks: their blocks are published
    prefilled_admissions: np.ndarray
    rows: np.ndarray  # every row of the step: the ones a failure of it is blamed on
    row_admissions: np.ndarray
    steady_next: bool  # every row then wants exactly one token: the next step is steady decode
    drafted: np.ndarray  # drafts each sampling row verifies; empty: none in the step

    @classmethod
    def record(
        cls,
        step: int,
        batch: RunningBatch,
        prefilled: np.ndarray,
        all_sample: bool,
        drafts: Drafts | None = None,
    ) -> StepInFlight:
        """Planned: the rows whose every known token is now computed (`all_sample`: every
        row, a steady decode step's) sample one more, and a placeholder holds its place (after
        a row's drafts, if it has any)."""
        order = batch.order
        admissions = batch.admission[order]
        if all_sample:
            sampling, sampling_admissions = order, admissions
        else:
            chosen = batch.samples(order)
            sampling, sampling_admissions = order[chosen], admissions[chosen]
        index = batch.hold_places(sampling)
        # A row whose placeholder is its last token computes nothing more (`wanted`).
        capped = bool((index + 1 >= batch.stop_len[sampling]).any())
        return cls(
            step=step,
            slots=sampling,
            admissions=sampling_admissions,
            req_ids=batch.req_ids[sampling],
            index=index,
            prefilled=prefilled,
            prefilled_admissions=batch.admission[prefilled] if len(prefilled) else prefilled,
            rows=order,
            row_admissions=admissions,
            steady_next=len(sampling) == len(order) and not capped,
            drafted=_NONE if drafts is None else drafts.per_row(sampling),
        )

    def live(self, batch: RunningBatch) -> np.ndarray:
        """Which sampling rows are still the rows they were."""
        return batch.admission[self.slots] == self.admissions

    def forget_drafts(self, batch: RunningBatch) -> None:
        """The step will never answer (its executor died): its rows' drafts, unverified, are
        not theirs to resume with; nor is the token after them."""
        drafting = np.flatnonzero(self.drafted)
        if len(drafting):
            live = drafting[self.live(batch)[drafting]]
            batch.num_tokens[self.slots[live]] = (self.index - self.drafted)[live]

    def still_prefilled(self, batch: RunningBatch) -> list[int]:
        keep = batch.admission[self.prefilled] == self.prefilled_admissions
        return self.prefilled[keep].tolist()

    def still_rows(self, batch: RunningBatch) -> list[int]:
        return self.rows[batch.admission[self.rows] == self.row_admissions].tolist()
