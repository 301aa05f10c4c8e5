"""When waiting requests may join the running batch: at any step (continuous batching), or only
into an empty batch (static batching, the baseline continuous batching is measured against)."""

from __future__ import annotations

from turnstile.shared.config import SchedulerConfig


class ContinuousAdmission:
    """A step whenever there is work; newcomers join any step; a finished row leaves at once."""

    pads_finished_rows = False

    def wants_step(self, running: int, waiting: int, oldest_wait: float | None) -> bool:
        return True

    def is_open(self, running: int) -> bool:
        return True


class StaticAdmission:
    """A batch is admitted only once the last one is done. It opens when full or once its first
    request has waited the fill timeout, so requests sent together share a batch, as at a static
    server with a batching window (and as `bench compare`'s ideal ratio assumes), though they
    reach the scheduler one by one. Padded: a finished row computes on, its tokens discarded,
    until its batch ends (as HF `generate`); compact: it leaves."""

    def __init__(self, padded: bool, fill_timeout: float, max_num_seqs: int) -> None:
        self.pads_finished_rows = padded
        self.fill_timeout = fill_timeout
        self.max_num_seqs = max_num_seqs

    def wants_step(self, running: int, waiting: int, oldest_wait: float | None) -> bool:
        if running or waiting >= self.max_num_seqs or oldest_wait is None:
            return True
        return oldest_wait >= self.fill_timeout

    def is_open(self, running: int) -> bool:
        return running == 0


Admission = ContinuousAdmission | StaticAdmission


def admission_for(config: SchedulerConfig) -> Admission:
    mode = config.scheduling.static_batching
    if mode is None:
        return ContinuousAdmission()
    return StaticAdmission(
        mode == "padded", config.scheduling.static_fill_timeout, config.max_num_seqs
    )
