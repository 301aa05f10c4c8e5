"""The scheduler service's settings: its sockets, the model it serves, its policy, its limits."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import StaticBatching


@dataclass(slots=True, frozen=True)
class SchedulerServiceConfig:
    gateway_address: str  # bound ROUTER: gateways' requests in, their outputs and status out
    executors_address: str  # bound ROUTER: executors register, take plans, return results
    model: str
    eos_token_id: int
    vocab_size: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    static_batching: StaticBatching | None = None
    static_fill_timeout: float = 1.0  # seconds; see `Scheduler.wants_step`
    max_waiting: int | None = None  # beyond it new requests are refused (HTTP 429)
    queue_timeout: float | None = None  # requests waiting longer never to run: HTTP 429
    step_timeout: float = 60.0  # a step not answered by then counts as a lost executor
    executor_timeout: float = 30.0  # requests fail if no executor is back by then
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
