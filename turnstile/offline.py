"""Offline generation: the scheduler and one executor in this process, same code as the
service, with the plans handed over directly instead of over ZeroMQ."""

from __future__ import annotations

from dataclasses import dataclass, field

from turnstile.executor_svc.model_runner import ModelRunner
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.scheduler_svc.scheduler import Scheduler
from turnstile.shared.config import SchedulerConfig, SchedulingConfig
from turnstile.shared.protocol import AddRequest, unpack_ids


@dataclass(slots=True)
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # of prompt tokens 1, 2, ...
    finish_reason: str | None = None
    error: str = ""


class OfflineEngine:
    def __init__(
        self, runner_config: RunnerConfig, scheduling: SchedulingConfig | None = None
    ) -> None:
        self.runner = ModelRunner(runner_config)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.runner.num_blocks,
                block_size=runner_config.engine.block_size,
                max_num_seqs=runner_config.engine.max_num_seqs,
                max_model_len=self.runner.max_model_len,
                scheduling=scheduling or SchedulingConfig(),
                sliding_window=self.runner.info.kv_window,
            ),
            eos_token_ids=self.runner.info.all_eos_token_ids,
            vocab_size=self.runner.info.vocab_size,
        )

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
        while self.scheduler.has_work:
            step = self.runner.execute(self.scheduler.schedule())
            outputs = self.scheduler.update(step)
            req_ids = unpack_ids(outputs.req_ids).tolist()
            tokens = unpack_ids(outputs.token_ids).tolist()
            for index, (req_id, token) in enumerate(zip(req_ids, tokens, strict=True)):
                results[req_id].token_ids.append(token)
                if step.logprobs and step.logprobs[index]:
                    results[req_id].logprobs.append(step.logprobs[index])
            for prompt in step.prompt_logprobs:
                results[prompt.req_id].prompt_logprobs += [e[0][1] for e in prompt.entries]
            for ended in outputs.finished:
                results[ended.req_id].finish_reason = ended.reason
                results[ended.req_id].error = ended.error
        return [results[request.req_id] for request in requests]
