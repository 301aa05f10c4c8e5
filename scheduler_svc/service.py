"""The scheduler process: requests in from gateways, plans out to executors, tokens back.

One thread, one poll loop. A step is in flight from sending its plan until its result comes
back; meanwhile new requests and aborts are queued and take effect at the next step.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

import zmq

from scheduler_svc.executor_link import ExecutorLink
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.scheduler import Scheduler
from shared.config import SchedulerConfig, StaticBatching
from shared.metrics_server import serve_metrics
from shared.protocol import (
    AbortRequest,
    AddRequest,
    EngineOutputs,
    Finished,
    Heartbeat,
    Register,
    RegisterReply,
    SchedulerStatus,
    StepResult,
    ToScheduler,
)
from shared.zmq_io import FrameCodec, make_socket

log = logging.getLogger(__name__)

STATUS_INTERVAL = 0.5
PROBE_DELAY = 0.2  # a second probe, in case the first ran before the peer's pipe closed


@dataclass(slots=True, frozen=True)
class SchedulerServiceConfig:
    requests_address: str  # bound PULL: gateways push AddRequest / AbortRequest
    outputs_address: str  # bound PUSH: EngineOutputs and SchedulerStatus to the gateway
    executors_address: str  # bound ROUTER: executors register, take plans, return results
    model: str
    eos_token_id: int
    num_executors: int = 1
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    static_batching: StaticBatching | None = None
    static_fill_timeout: float = 1.0  # seconds; see `_filling_static_batch`
    max_waiting: int | None = None  # beyond it new requests are refused (HTTP 429)
    queue_timeout: float | None = None  # requests waiting longer never to run: HTTP 429
    step_timeout: float = 60.0  # a step not answered by then counts as a lost executor
    executor_timeout: float = 30.0  # requests fail if no executor is back by then
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"


class SchedulerService:
    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        context = zmq.Context.instance()
        self.requests = make_socket(context, zmq.PULL, config.requests_address, bind=True)
        self.outputs = make_socket(context, zmq.PUSH, config.outputs_address, bind=True)
        self.request_codec: FrameCodec[ToScheduler] = FrameCodec(ToScheduler, "scheduler.requests")
        self.link = ExecutorLink(
            config.executors_address,
            config.num_executors,
            config.block_size,
            config.max_num_seqs,
            config.model,
        )
        self.metrics = SchedulerMetrics()
        self.scheduler: Scheduler | None = None
        self.in_flight: tuple[int, float] | None = None  # step number, send time
        self.lost_since: float | None = None
        self.instance = secrets.randbits(62)
        self._last_status = 0.0
        self._probe_at: float | None = None

    def serve_forever(self) -> None:
        if self.config.metrics_port is not None:
            serve_metrics(self.config.metrics_port, self.config.metrics_host)
        poller = zmq.Poller()
        poller.register(self.requests, zmq.POLLIN)
        poller.register(self.link.socket, zmq.POLLIN)
        poller.register(self.link.disconnects, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(timeout=int(STATUS_INTERVAL * 1000)))
            if self.link.disconnects in ready:
                self.link.disconnects.recv_multipart()
                self._probe_executors()
                self._probe_at = time.monotonic() + PROBE_DELAY
            if self.link.socket in ready:
                self._drain_executors()
            self._check_timeouts()
            if self.requests in ready:
                self._drain_requests()
            self._maybe_step()
            if time.monotonic() - self._last_status >= STATUS_INTERVAL:
                self._send_status()

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and self.link.complete

    def _executor_lost(self, why: str) -> None:
        if not self.link.peers or self.scheduler is None:
            return
        log.error("%s: re-queueing %d running requests", why, len(self.scheduler.batch))
        self.link.peers.clear()
        self.in_flight = None
        self.lost_since = time.monotonic()
        self.scheduler.restart(self.scheduler.pool.num_blocks)
        self._send_status()

    def _probe_executors(self) -> None:
        gone = self.link.probe()
        if gone is not None:
            self._executor_lost(f"executor rank {gone} disconnected")

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        if self.config.queue_timeout is not None and self.scheduler is not None:
            self.scheduler.expire_waiting(now, self.config.queue_timeout)
            if self.in_flight is None:
                self._flush_finished()
        if self._probe_at is not None and now >= self._probe_at:
            self._probe_at = None
            self._probe_executors()
        if self.in_flight is not None and now - self.in_flight[1] > self.config.step_timeout:
            self._executor_lost(f"step {self.in_flight[0]} unanswered")
        if self.lost_since is not None and now - self.lost_since > self.config.executor_timeout:
            assert self.scheduler is not None
            error = f"no executor came back within {self.config.executor_timeout:.0f} s"
            log.error("%s: failing %d requests", error, len(self.scheduler.requests))
            self.scheduler.fail_all(error)
            self._flush_finished()
            self.lost_since = None

    def _drain_requests(self) -> None:
        while self.requests.poll(0):
            message = self.request_codec.decode(self.requests.recv())
            if message is None:
                continue
            if not self.ready:
                if isinstance(message, AddRequest):
                    self._fail(message.req_id, "no executor is ready", "unavailable")
                continue
            if isinstance(message, AbortRequest):
                self.scheduler.abort(message.req_id)
                continue
            if message.req_id in self.scheduler.requests:
                # A replayed or duplicated frame: failing the id would end the live request.
                self.request_codec.count_malformed("a second AddRequest for a live request id")
                continue
            limit = self.config.max_waiting
            if limit is not None and len(self.scheduler.waiting) >= limit:
                self._fail(message.req_id, f"{limit} requests are already waiting", "overloaded")
                continue
            try:
                self.scheduler.add_request(message, now=time.monotonic())
            except ValueError as exc:
                self._fail(message.req_id, str(exc))
        if self.scheduler is not None and self.in_flight is None:
            self._flush_finished()

    def _drain_executors(self) -> None:
        for identity, message in self.link.receive():
            if isinstance(message, Register):
                self._register(identity, message)
            elif isinstance(message, StepResult):
                self._finish_step(message)
            elif isinstance(message, Heartbeat) and identity not in self.link.peers.values():
                reply = RegisterReply(False, "unknown executor (the scheduler restarted)")
                self.link.send_to(identity, reply)

    def _register(self, identity: bytes, hello: Register) -> None:
        config = self.config
        reason = self.link.refusal(hello)
        first_step = self.scheduler.step + 1 if self.scheduler else 1
        self.link.send_to(identity, RegisterReply(not reason, reason, first_step))
        if reason:
            log.error("refused an executor: %s", reason)
            return
        self.link.peers[hello.rank] = identity
        log.info("executor rank %d registered with %d KV blocks", hello.rank, hello.num_blocks)
        if self.scheduler is not None and self.ready:
            self.scheduler.restart(hello.num_blocks)  # a replacement: its cache is empty
            self.lost_since = None
            self._send_status()
        elif self.scheduler is None and self.link.complete:
            self.scheduler = Scheduler(
                SchedulerConfig(
                    num_blocks=hello.num_blocks,
                    block_size=config.block_size,
                    max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    max_model_len=min(config.max_model_len, hello.max_model_len),
                    policy=config.policy,  # type: ignore[arg-type]
                    enable_prefix_caching=config.enable_prefix_caching,
                    static_batching=config.static_batching,
                ),
                eos_token_id=config.eos_token_id,
            )
            self._send_status()

    def _maybe_step(self) -> None:
        scheduler = self.scheduler
        if scheduler is None or not self.ready or self.in_flight is not None:
            return
        if not scheduler.has_work or self._filling_static_batch(scheduler):
            return
        started = time.perf_counter()
        plan_bytes, unreachable = self.link.broadcast(scheduler.schedule())
        self.metrics.step_seconds.observe(time.perf_counter() - started)
        self.metrics.plan_bytes.observe(plan_bytes)
        self.in_flight = (scheduler.step, time.perf_counter())
        if unreachable is not None:
            self._executor_lost(f"executor rank {unreachable} cannot take plans")

    def _filling_static_batch(self, scheduler: Scheduler) -> bool:
        """Whether a static server should wait for more requests before opening its next
        batch. It waits until the batch is full or its first request has waited the fill
        timeout, so requests sent together share a batch, as at a static server with a batching
        window (and as `bench compare`'s ideal ratio assumes), even though they reach the
        scheduler one by one."""
        config = self.config
        if config.static_batching is None or len(scheduler.batch) > 0:
            return False
        if len(scheduler.waiting) >= config.max_num_seqs:
            return False
        first = scheduler.waiting.peek()
        waited = time.monotonic() - first.arrived_at if first is not None else 0.0
        return first is not None and waited < config.static_fill_timeout

    def _finish_step(self, result: StepResult) -> None:
        scheduler = self.scheduler
        if scheduler is None or self.in_flight is None or result.step != self.in_flight[0]:
            log.warning("dropped a result for step %d, which is not in flight", result.step)
            return
        received = time.perf_counter()
        self.metrics.executor_seconds.observe(received - self.in_flight[1])
        self.in_flight = None
        outputs = scheduler.update(result)
        self.metrics.step_seconds.observe(time.perf_counter() - received)
        self._send_outputs(outputs)
        self._maybe_step()

    def _fail(self, req_id: int, error: str, reason: str = "error") -> None:
        self._send_outputs(EngineOutputs(step=0, finished=[Finished(req_id, reason, error)]))

    def _flush_finished(self) -> None:
        assert self.scheduler is not None
        finished = self.scheduler.take_finished()
        if finished:
            self._send_outputs(EngineOutputs(step=self.scheduler.step, finished=finished))

    def _send_outputs(self, outputs: EngineOutputs) -> None:
        for ended in outputs.finished:
            self.metrics.finished.labels(ended.reason).inc()
        self._send_to_gateway(outputs)

    def _send_status(self) -> None:
        self._last_status = time.monotonic()
        scheduler = self.scheduler
        if scheduler is not None:
            self.metrics.observe(scheduler)
        pool = scheduler.pool if scheduler else None
        status = SchedulerStatus(
            instance=self.instance,
            ready=self.ready,
            num_running=len(scheduler.batch) if scheduler else 0,
            num_waiting=len(scheduler.waiting) if scheduler else 0,
            kv_cache_usage=pool.num_used / pool.num_blocks if pool else 0.0,
        )
        self._send_to_gateway(status)

    def _send_to_gateway(self, message: EngineOutputs | SchedulerStatus) -> None:
        # Never block the loop on a missing or stalled gateway: with no one to read them,
        # these messages have no reader to lose.
        try:
            self.outputs.send(self.request_codec.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.debug("no gateway is reading; dropped a %s", type(message).__name__)
