"""The plans sent to the executors and not yet answered, oldest first: with async scheduling
the next one waits at the executor while it runs the current one."""

from __future__ import annotations

import time
from collections import deque

from turnstile.shared.config import SchedulingConfig


def plans_ahead(scheduling: SchedulingConfig) -> int:
    """How many plans may be out unanswered: two with async scheduling, else one."""
    # A static batch ends before the next is planned: the baseline stays a static server. A
    # row's drafts are made from the tokens its last step kept, so speculation waits for them.
    ahead = scheduling.async_scheduling and scheduling.static_batching is None
    ahead = ahead and scheduling.speculative_config is None
    return 2 if ahead else 1


class PlansInFlight:
    def __init__(self, scheduling: SchedulingConfig) -> None:
        self.limit = plans_ahead(scheduling)
        self._sent: deque[tuple[int, float]] = deque()  # step, when sent
        self._last_answer = 0.0

    def __len__(self) -> int:
        return len(self._sent)

    @property
    def has_room(self) -> bool:
        return len(self._sent) < self.limit

    @property
    def oldest(self) -> tuple[int, float] | None:
        return self._sent[0] if self._sent else None

    def sent(self, step: int) -> None:
        self._sent.append((step, time.perf_counter()))

    def answered(self, received: float) -> float:
        """The oldest is answered: the executor's time on it, from when it could start (sent,
        or the previous answer back, whichever came later)."""
        _, sent = self._sent.popleft()
        seconds = received - max(sent, self._last_answer)
        self._last_answer = received
        return seconds

    def clear(self) -> None:
        self._sent.clear()
