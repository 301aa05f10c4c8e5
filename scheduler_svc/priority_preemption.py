"""The priority policy's preemption: a running row gives way to a better-ranked waiting
request that could not otherwise start this step."""

from __future__ import annotations

from turnstile.scheduler_svc.lifecycle import RequestLifecycle
from turnstile.scheduler_svc.token_budget import split_budget
from turnstile.shared.batch_table import cdiv
from turnstile.shared.config import SchedulerConfig


def preempt_for_higher_priority(
    lifecycle: RequestLifecycle, config: SchedulerConfig, budget: int
) -> None:
    """Preempt lower-priority running rows while the best waiting request cannot get in."""
    batch = lifecycle.batch
    while (head := lifecycle.waiting.peek()) is not None and len(batch):
        rows = batch.order
        worst = int(rows[batch.rank[rows].argmax()])
        if head.rank(by_priority=True) >= batch.rank[worst]:
            return
        scheduled = split_budget(batch.wanted(rows), budget, config.whole_prompts)
        room = budget - int(scheduled.sum())
        if room <= 0:
            return
        running_need = int(batch.blocks_needed(rows, scheduled).sum())
        head_need = cdiv(min(len(head.token_ids), room), config.block_size)
        if len(batch) < config.max_num_seqs and (
            lifecycle.pool.num_free - running_need >= head_need
        ):
            return
        lifecycle.preempt(worst)
