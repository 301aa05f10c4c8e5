"""The real scheduler driving a model runner one step ahead, as the async service does: step
N+1 is planned (and launched) before step N's answer is back."""

from __future__ import annotations

from collections.abc import Callable

from turnstile.executor_svc.model_runner import ModelRunner
from turnstile.executor_svc.step_in_flight import PendingStep
from turnstile.offline import run_steps
from turnstile.scheduler_svc.scheduler import Scheduler
from turnstile.shared.config import SchedulerConfig
from turnstile.shared.protocol import AddRequest, BatchPlan, StepResult
from turnstile.shared.settings import build


def scheduler_for(
    runner: ModelRunner, requests: list[AddRequest], **config: int | str
) -> Scheduler:
    """A scheduler over the runner's KV cache (blocks of 16), holding `requests`."""
    scheduler = Scheduler(
        build(
            SchedulerConfig,
            num_blocks=runner.num_blocks,
            block_size=16,
            max_model_len=runner.max_model_len,
            **config,
        ),
        eos_token_ids=runner.info.all_eos_token_ids,
        vocab_size=runner.info.vocab_size,
    )
    runner.reset(1)
    for request in requests:
        scheduler.add_request(request)
    return scheduler


def answers(scheduler: Scheduler, launch: Callable[[BatchPlan], PendingStep]) -> list[StepResult]:
    """Every step's answer, in order, until the scheduler has no work."""
    return [answer for answer, _ in run_steps(scheduler, launch, ahead=2)]
