"""Progress lines while a model's weights load: a large model takes minutes, and a log that
says nothing meanwhile looks like a hang. Quiet for loads under a second."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

QUIET_S = 1.0  # no line before a load has taken this long
EVERY_S = 1.0  # then at most a line a second, and one when it ends


class LoadProgress:
    def __init__(self, what: str, total: int, unit: str) -> None:
        self.what, self.total, self.unit = what, total, unit
        self._start = self._last = time.monotonic()

    def advance(self, done: int) -> None:
        """`done` of `total` units are loaded."""
        now = time.monotonic()
        if now - self._start < QUIET_S or (done < self.total and now - self._last < EVERY_S):
            return
        self._last = now
        log.info("loading %s: %d/%d %s (%.0f%%, %.1f s)", self.what, done, self.total,
                 self.unit, 100 * done / self.total, now - self._start)  # fmt: skip
