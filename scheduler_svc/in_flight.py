"""A step sent and not yet answered: which rows sample in it and where each token goes.

Results come back in order, but by then a row may have left (ended, aborted, preempted) and
its slot gone to another request: the admission each row had when the step was planned tells
a late token from a live one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from turnstile.scheduler_svc.running_batch import RunningBatch


@dataclass(slots=True, frozen=True)
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

    @classmethod
    def record(cls, step: int, batch: RunningBatch, prefilled: np.ndarray) -> StepInFlight:
        """Planned: the rows whose every known token is now computed sample one more, and a
        placeholder holds its place."""
        order = batch.order
        sampling = order[batch.samples(order)]
        return cls(
            step=step,
            slots=sampling,
            admissions=batch.admission[sampling],
            req_ids=batch.req_ids[sampling],
            index=batch.hold_places(sampling),
            prefilled=prefilled,
            prefilled_admissions=batch.admission[prefilled],
            rows=order,
            row_admissions=batch.admission[order],
        )

    def live(self, batch: RunningBatch) -> np.ndarray:
        """Which sampling rows are still the rows they were."""
        return batch.admission[self.slots] == self.admissions

    def still_prefilled(self, batch: RunningBatch) -> list[int]:
        keep = batch.admission[self.prefilled] == self.prefilled_admissions
        return self.prefilled[keep].tolist()

    def still_rows(self, batch: RunningBatch) -> list[int]:
        return self.rows[batch.admission[self.rows] == self.row_admissions].tolist()
