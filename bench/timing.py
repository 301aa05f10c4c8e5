"""Timing a callable in-process: the median of repeated runs after a warm one."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # warm: caches built, pages touched
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3
