"""vLLM's periodic stats line, from the scheduler: prompt and generation throughput over the last
interval, the running and waiting requests, preemptions, KV cache usage, prefix cache hit rate.
An idle engine's line goes to DEBUG, as vLLM keeps an idle server's log quiet."""

from __future__ import annotations

import logging
import time

from turnstile.scheduler_svc.scheduler import Scheduler

log = logging.getLogger(__name__)


class StatsLog:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._since = time.monotonic()
        self._seen = (0, 0, 0, 0)  # queries, hits, generated, preemptions
        self._busy_before = False

    def maybe_log(self, scheduler: Scheduler) -> None:
        """A line once `interval` seconds have passed since the last."""
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < self.interval:
            return
        stats = scheduler.stats
        seen = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.generation_tokens,
                stats.num_preemptions)  # fmt: skip
        queries, hits, generated, preempted = (b - a for a, b in zip(self._seen, seen, strict=True))
        self._since, self._seen = now, seen
        busy = bool(queries or generated)
        level = logging.INFO if busy or self._busy_before else logging.DEBUG
        self._busy_before = busy
        parts = [
            f"Avg prompt throughput: {(queries - hits) / elapsed:.1f} tokens/s",  # computed
            f"Avg generation throughput: {generated / elapsed:.1f} tokens/s",
            f"Running: {len(scheduler.batch)} reqs",
            f"Waiting: {scheduler.num_waiting} reqs",
        ]
        if preempted:
            parts.append(f"Preemptions: {preempted}")
        pool = scheduler.pool
        parts.append(f"KV cache usage: {100 * pool.num_used / pool.num_blocks:.1f}%")
        if queries:
            parts.append(f"Prefix cache hit rate: {100 * hits / queries:.1f}%")
        log.log(level, ", ".join(parts))
