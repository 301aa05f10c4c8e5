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

from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.scheduler import Scheduler
from shared.config import SchedulerConfig, StaticBatching
from shared.metrics_server import serve_metrics
from shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    AddRequest,
    EngineOutputs,
    ExecutorToScheduler,
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
        self.executors = make_socket(context, zmq.ROUTER, config.executors_address, bind=True)
        self.request_codec: FrameCodec[ToScheduler] = FrameCodec(ToScheduler, "scheduler.requests")
        self.executor_codec: FrameCodec[ExecutorToScheduler] = FrameCodec(
            ExecutorToScheduler, "scheduler.executors"
        )
        self.metrics = SchedulerMetrics()
        self.scheduler: Scheduler | None = None
        self.peers: dict[int, bytes] = {}  # rank -> ZeroMQ identity
        self.in_flight: tuple[int, float] | None = None  # step number, send time
        self.lost_since: float | None = None
        self.instance = secrets.randbits(62)
        self._last_status = 0.0
        # A killed executor's TCP connection drops at once: the monitor reports it in
        # milliseconds, where a heartbeat would take seconds.
        # Any peer's drop raises it, a stray client's too, so each executor is then probed:
        # with ROUTER_MANDATORY a send to a vanished peer fails at once.
        self.disconnects = self.executors.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.executors.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._probe_at: float | None = None

    def serve_forever(self) -> None:
        if self.config.metrics_port is not None:
            serve_metrics(self.config.metrics_port, self.config.metrics_host)
        poller = zmq.Poller()
        poller.register(self.requests, zmq.POLLIN)
        poller.register(self.executors, zmq.POLLIN)
        poller.register(self.disconnects, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(timeout=int(STATUS_INTERVAL * 1000)))
            if self.disconnects in ready:
                self.disconnects.recv_multipart()
                self._probe_executors()
                self._probe_at = time.monotonic() + PROBE_DELAY
            if self.executors in ready:
                self._drain_executors()
            self._check_timeouts()
            if self.requests in ready:
                self._drain_requests()
            self._maybe_step()
            if time.monotonic() - self._last_status >= STATUS_INTERVAL:
                self._send_status()

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and len(self.peers) == self.config.num_executors

    def _executor_lost(self, why: str) -> None:
        if not self.peers or self.scheduler is None:
            return
        log.error("%s: re-queueing %d running requests", why, len(self.scheduler.batch))
        self.peers.clear()
        self.in_flight = None
        self.lost_since = time.monotonic()
        self.scheduler.restart(self.scheduler.pool.num_blocks)
        self._send_status()

    def _send_to(self, identity: bytes, frame: bytes) -> bool:
        try:
            self.executors.send_multipart([identity, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # EHOSTUNREACH: gone; EAGAIN: not reading at all
            return False
        return True

    def _probe_executors(self) -> None:
        probe = self.executor_codec.encode(Heartbeat(-1))
        for rank, identity in list(self.peers.items()):
            if not self._send_to(identity, probe):
                self._executor_lost(f"executor rank {rank} disconnected")
                return

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
        while self.executors.poll(0):
            identity, frame = self.executors.recv_multipart()
            message = self.executor_codec.decode(frame)
            if isinstance(message, Register):
                self._register(identity, message)
            elif isinstance(message, StepResult):
                self._finish_step(message)
            elif isinstance(message, Heartbeat) and identity not in self.peers.values():
                reply = RegisterReply(False, "unknown executor (the scheduler restarted)")
                self._send_to(identity, self.executor_codec.encode(reply))

    def _register(self, identity: bytes, hello: Register) -> None:
        config = self.config
        expected = (PROTOCOL_VERSION, config.block_size, config.max_num_seqs, config.model)
        offered = (hello.version, hello.block_size, hello.max_num_seqs, hello.model)
        reason = ""
        if offered != expected:
            reason = f"executor offers (version, block_size, max_num_seqs, model) = {offered}; "
            reason += f"this scheduler runs {expected}"
        elif not 0 <= hello.rank < config.num_executors:
            reason = f"rank {hello.rank} is outside 0..{config.num_executors - 1}"
        first_step = self.scheduler.step + 1 if self.scheduler else 1
        reply = RegisterReply(not reason, reason, first_step)
        self._send_to(identity, self.executor_codec.encode(reply))
        if reason:
            log.error("refused an executor: %s", reason)
            return
        self.peers[hello.rank] = identity
        log.info("executor rank %d registered with %d KV blocks", hello.rank, hello.num_blocks)
        if self.scheduler is not None and self.ready:
            self.scheduler.restart(hello.num_blocks)  # a replacement: its cache is empty
            self.lost_since = None
            self._send_status()
        elif self.scheduler is None and len(self.peers) == config.num_executors:
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
        if not scheduler.has_work:
            return
        started = time.perf_counter()
        frame = self.executor_codec.encode(scheduler.schedule())
        self.metrics.step_seconds.observe(time.perf_counter() - started)
        self.metrics.plan_bytes.observe(len(frame))
        self.in_flight = (scheduler.step, time.perf_counter())
        for rank, identity in list(self.peers.items()):
            if not self._send_to(identity, frame):
                self._executor_lost(f"executor rank {rank} cannot take plans")
                return

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
