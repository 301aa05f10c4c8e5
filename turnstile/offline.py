"""Offline generation: the scheduler and one executor in this process, same code as the
service, with the plans handed over directly instead of over ZeroMQ, as many steps ahead."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from turnstile.executor_svc.model_runner import ModelRunner
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.executor_svc.step_in_flight import PendingStep
from turnstile.scheduler_svc.plans_in_flight import plans_ahead
from turnstile.scheduler_svc.scheduler import Scheduler
from turnstile.shared.config import SchedulerConfig, SchedulingConfig
from turnstile.shared.protocol import (
    AddRequest,
    BatchPlan,
    EngineOutputs,
    StepResult,
    unpack_ids,
)


@dataclass(slots=True)
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # of prompt tokens 1, 2, ...
    finish_reason: str | None = None
    error: str = ""


def run_steps(
    scheduler: Scheduler, launch: Callable[[BatchPlan], PendingStep], ahead: int
) -> Iterator[tuple[StepResult, EngineOutputs]]:
    """Each step's answer and what the scheduler made of it, in order, until it has no work.
    Up to `ahead` steps are launched and unanswered, so with two the next step is planned and
    launched while the device runs the one before, as the async service does."""
    pending: deque[PendingStep] = deque()
    while scheduler.has_work or pending:
        while scheduler.has_work and len(pending) < ahead:
            pending.append(launch(scheduler.schedule()))
        answer = pending.popleft().result()
        yield answer, scheduler.update(answer)


class OfflineEngine:
    def __init__(
        self, runner_config: RunnerConfig, scheduling: SchedulingConfig | None = None
    ) -> None:
        scheduling = scheduling or SchedulingConfig()
        self.runner = ModelRunner(runner_config)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.runner.num_blocks,
                block_size=runner_config.engine.block_size,
                max_num_seqs=runner_config.engine.max_num_seqs,
                max_model_len=self.runner.max_model_len,
                scheduling=scheduling,
                sliding_window=self.runner.info.kv_window,
                max_loras=self.runner.max_loras,
                max_logprobs=runner_config.engine.max_logprobs,
                whole_prompts=self.runner.info.encoder_only,
            ),
            eos_token_ids=self.runner.info.all_eos_token_ids,
            vocab_size=self.runner.info.vocab_size,
        )
        self.ahead = plans_ahead(scheduling)

    def generate(self, requests: list[AddRequest]) -> list[Completion]:
        """Run all requests together; results in input order. A refused request gets
        finish_reason "error" and the reason, and the others run on."""
        results = {request.req_id: Completion() for request in requests}
        for request in requests:
            try:
                self.scheduler.add_request(request)
            except ValueError as exc:
                results[request.req_id].finish_reason = "error"
                results[request.req_id].error = str(exc)
        for _, outputs in run_steps(self.scheduler, self.runner.launch, self.ahead):
            req_ids = unpack_ids(outputs.req_ids).tolist()
            tokens = unpack_ids(outputs.token_ids).tolist()
            for index, (req_id, token) in enumerate(zip(req_ids, tokens, strict=True)):
                results[req_id].token_ids.append(token)
                if outputs.logprobs and outputs.logprobs[index]:
                    results[req_id].logprobs.append(outputs.logprobs[index])
            for prompt in outputs.prompt_logprobs:
                results[prompt.req_id].prompt_logprobs += [e[0][1] for e in prompt.entries]
            for ended in outputs.finished:
                results[ended.req_id].finish_reason = ended.reason
                results[ended.req_id].error = ended.error
        return [results[request.req_id] for request in requests]
