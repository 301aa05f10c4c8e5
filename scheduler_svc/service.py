"""The scheduler process: requests in from gateways, plans out to executors, tokens back.

One thread, one poll loop. A step is in flight from sending its plan until its result comes
back; meanwhile new requests and aborts are queued and take effect at the next step.
"""

from __future__ import annotations

import logging
import secrets
import time

import msgspec
import zmq

from turnstile.scheduler_svc.executor_link import ExecutorLink
from turnstile.scheduler_svc.gateway_link import LOCAL_ID_BITS, GatewayLink
from turnstile.scheduler_svc.metrics import SchedulerMetrics
from turnstile.scheduler_svc.plans_in_flight import PlansInFlight
from turnstile.scheduler_svc.scheduler import Scheduler
from turnstile.scheduler_svc.service_config import SchedulerServiceConfig
from turnstile.shared.config import SchedulerConfig
from turnstile.shared.metrics_server import serve_metrics
from turnstile.shared.model_info import served_name
from turnstile.shared.protocol import (
    AbortRequest,
    AddRequest,
    EngineOutputs,
    FrameError,
    Heartbeat,
    Register,
    RegisterReply,
    SchedulerStatus,
    StepFailed,
    StepResult,
)
from turnstile.shared.zmq_io import scheduler_addresses

log = logging.getLogger(__name__)

STATUS_INTERVAL = 0.5
PROBE_DELAY = 0.2  # a second probe, in case the first ran before the peer's pipe closed


class SchedulerService:
    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.model = config.engine.model_info()
        gateway_address, executors_address = scheduler_addresses(config.addresses)
        self.gateways = GatewayLink(gateway_address)
        self.link = ExecutorLink(
            executors_address,
            config.engine.block_size,
            config.engine.max_num_seqs,
            served_name(config.engine.model_path),
            self.model.vocab_size,
            config.engine.tensor_parallel_size,
        )
        self.metrics = SchedulerMetrics(config.metrics)
        self.scheduler: Scheduler | None = None
        self.in_flight = PlansInFlight(config.scheduling)
        self.lost_since: float | None = None
        self.instance = secrets.randbits(62)
        self._last_status = 0.0
        self._probe_at: float | None = None

    def serve_forever(self) -> None:
        serve_metrics(self.config.metrics)
        poller = zmq.Poller()
        sockets = (self.gateways.socket, self.gateways.disconnects, self.link.socket)
        for socket in (*sockets, self.link.disconnects):
            poller.register(socket, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(timeout=int(STATUS_INTERVAL * 1000)))
            if self.link.disconnects in ready:
                self.link.disconnects.recv_multipart()
                self._drain_executors()  # what a leaving executor sent last (its StepFailed) first
                self._probe_executors()
                self._probe_at = time.monotonic() + PROBE_DELAY
            if self.gateways.disconnects in ready:
                self.gateways.disconnects.recv_multipart()
                self._send_status()  # a send to a gateway that is gone finds it
                self._probe_at = time.monotonic() + PROBE_DELAY
            if self.link.socket in ready:
                self._drain_executors()
            self._check_timeouts()
            if self.gateways.socket in ready:
                self._drain_requests()
            self._maybe_step()
            if time.monotonic() - self._last_status >= STATUS_INTERVAL:
                self._send_status()

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and self.link.complete

    def _executor_lost(self, why: str) -> None:
        """Every executor is dropped (they re-register) and the running rows re-queued; with a
        step in flight, `why` is its failure, for the quarantine of `Scheduler.restart`."""
        if not self.link.peers or self.scheduler is None:
            return
        log.error("%s: re-queueing %d running requests", why, len(self.scheduler.batch))
        self.link.peers.clear()
        self.in_flight.clear()
        self.lost_since = time.monotonic()
        self.scheduler.restart(self.scheduler.pool.num_blocks, failure=why)
        self._send_status()  # first: a client told of a failed request then finds us unready
        self._flush_finished()

    def _probe_executors(self) -> None:
        gone = self.link.probe()
        if gone is not None:
            self._executor_lost(f"executor rank {gone} disconnected")

    def _check_timeouts(self) -> None:
        now, limits = time.monotonic(), self.config.admission
        if limits.queue_timeout is not None and self.scheduler is not None:
            self.scheduler.expire_waiting(now, limits.queue_timeout)
            self._flush_finished()
        if self._probe_at is not None and now >= self._probe_at:
            self._probe_at = None
            self._probe_executors()
            self._send_status()
        oldest = self.in_flight.oldest
        if oldest is not None and now - oldest[1] > limits.step_timeout:
            self._executor_lost(f"step {oldest[0]} unanswered")
        if self.lost_since is not None and now - self.lost_since > limits.executor_timeout:
            assert self.scheduler is not None
            error = f"no executor came back within {limits.executor_timeout:.0f} s"
            log.error("%s: failing %d requests", error, len(self.scheduler.requests))
            self.scheduler.fail_all(error)
            self._flush_finished()
            self.lost_since = None

    def _drain_requests(self) -> None:
        for slot, message in self.gateways.receive():
            if isinstance(message, Heartbeat):
                continue  # a gateway's sign of life: receiving it attached the gateway
            key = self.gateways.key(slot, message.req_id)
            if key is None:
                self.gateways.codec.count_malformed(f"request id {message.req_id} out of range")
            elif isinstance(message, AbortRequest):
                if self.scheduler is not None:  # honoured in every state
                    self.scheduler.abort(key)
            elif not self.ready:
                self.gateways.refuse(slot, message.req_id, "unavailable", "no executor is ready")
            elif key in self.scheduler.requests:
                # A replayed or duplicated frame: failing the id would end the live request.
                self.gateways.codec.count_malformed("a second AddRequest for a live request id")
            else:
                self._add(slot, key, message)
        if self.scheduler is not None:
            self._flush_finished()

    def _add(self, slot: int, key: int, message: AddRequest) -> None:
        assert self.scheduler is not None
        limit = self.config.admission.max_waiting
        if limit is not None and self.scheduler.num_waiting >= limit:
            error = f"{limit} requests are already waiting"
            self.gateways.refuse(slot, message.req_id, "overloaded", error)
            return
        try:
            self.scheduler.add_request(
                msgspec.structs.replace(message, req_id=key), now=time.monotonic()
            )
        except ValueError as exc:
            self.gateways.refuse(slot, message.req_id, "error", str(exc))

    def _drain_executors(self) -> None:
        for identity, message in self.link.receive():
            rank = self.link.rank_of(identity)
            if isinstance(message, Register):
                self._register(identity, message)
            elif rank is None:
                if isinstance(message, Heartbeat):
                    reply = RegisterReply(False, "unknown executor", retry=True)
                    self.link.send_to(identity, reply)
                else:
                    self.link.codec.count_malformed("a result from an unregistered executor")
            elif isinstance(message, StepResult | StepFailed) and rank != 0:
                self.link.codec.count_malformed(f"a result from rank {rank}; rank 0 answers")
            elif isinstance(message, StepFailed):
                self._executor_lost(f"executor rank 0 failed step {message.step}: {message.error}")
            elif isinstance(message, StepResult):
                self._finish_step(message)

    def _register(self, identity: bytes, hello: Register) -> None:
        engine = self.config.engine
        reason = self.link.refusal(hello)
        other = self.link.peers.get(hello.rank) not in (None, identity)
        retry = not reason and other and self.link.alive(hello.rank)
        if retry:
            reason = f"rank {hello.rank} is served by a live executor"
        elif not reason and hello.rank in self.link.peers:
            self._executor_lost(f"executor rank {hello.rank} registered again")
        first_step = self.scheduler.step + 1 if self.scheduler else 1
        self.link.send_to(identity, RegisterReply(not reason, reason, first_step, retry))
        if reason:
            log.error("refused an executor: %s", reason)
            return
        self.link.peers[hello.rank], self.link.offers[hello.rank] = identity, hello
        log.info("executor rank %d registered with %d KV blocks", hello.rank, hello.num_blocks)
        if self.scheduler is not None and self.ready:
            self.scheduler.restart(hello.num_blocks)  # a replacement: its cache is empty
            self.lost_since = None
            self._send_status()
        elif self.scheduler is None and self.link.complete:
            context = engine.max_model_len or self.model.max_model_len
            self.scheduler = Scheduler(
                SchedulerConfig(
                    num_blocks=hello.num_blocks,
                    block_size=engine.block_size,
                    max_num_seqs=engine.max_num_seqs,
                    max_model_len=min(context, hello.max_model_len),
                    scheduling=self.config.scheduling,
                    sliding_window=self.model.kv_window,
                    max_loras=hello.max_loras,
                    max_logprobs=engine.max_logprobs,
                    whole_prompts=self.model.encoder_only,
                ),
                eos_token_ids=self.model.all_eos_token_ids,
                vocab_size=self.model.vocab_size,
            )
            self._send_status()

    def _maybe_step(self) -> None:
        scheduler = self.scheduler
        while scheduler is not None and self.ready and self.in_flight.has_room:
            if not scheduler.wants_step(time.monotonic()):
                return
            started = time.perf_counter()
            plan_bytes, unreachable = self.link.broadcast(scheduler.schedule())
            self.metrics.step_seconds.observe(time.perf_counter() - started)
            self.metrics.plan_bytes.observe(plan_bytes)
            self.in_flight.sent(scheduler.step)
            self.metrics.plans_in_flight.set(len(self.in_flight))
            if unreachable is not None:
                self._drain_executors()  # its StepFailed, with the cause, first
                self._executor_lost(f"executor rank {unreachable} cannot take plans")

    def _finish_step(self, result: StepResult) -> None:
        scheduler = self.scheduler
        oldest = self.in_flight.oldest
        if scheduler is None or oldest is None or result.step != oldest[0]:
            log.warning("dropped a result for step %d, not the oldest in flight", result.step)
            return
        received = time.perf_counter()
        try:
            outputs = scheduler.update(result)
        except FrameError as exc:
            # From the registered rank 0, so its batch no longer matches ours: start again.
            self.link.codec.count_malformed(str(exc))
            self._executor_lost(f"step {result.step}'s result did not fit the step: {exc}")
            return
        self.metrics.executor_seconds.observe(self.in_flight.answered(received))
        self.metrics.plans_in_flight.set(len(self.in_flight))
        self.metrics.step_seconds.observe(time.perf_counter() - received)
        self._send_outputs(outputs)
        self._maybe_step()

    def _flush_finished(self) -> None:
        assert self.scheduler is not None
        finished = self.scheduler.take_finished()
        if finished:
            self._send_outputs(EngineOutputs(step=self.scheduler.step, finished=finished))

    def _send_outputs(self, outputs: EngineOutputs) -> None:
        for ended in outputs.finished:
            self.metrics.finished.labels(ended.reason).inc()
        self.gateways.send_outputs(outputs)

    def _send_status(self) -> None:
        """Status to every gateway; a gateway found gone has its requests ended."""
        self._last_status = time.monotonic()
        scheduler = self.scheduler
        pool = scheduler.pool if scheduler else None
        status = SchedulerStatus(
            instance=self.instance,
            ready=self.ready,
            num_running=len(scheduler.batch) if scheduler else 0,
            num_waiting=scheduler.num_waiting if scheduler else 0,
            kv_cache_usage=pool.num_used / pool.num_blocks if pool else 0.0,
            num_blocks=pool.num_blocks if pool else 0,
        )
        gone = self.gateways.broadcast(status)
        if gone and scheduler is not None:
            orphans = [key for key in scheduler.requests if key >> LOCAL_ID_BITS in gone]
            if orphans:
                log.warning("a gateway is gone; aborting its %d requests", len(orphans))
            for key in orphans:
                scheduler.abort(key)
            self._flush_finished()
        self.gateways.release(scheduler.requests if scheduler else ())
        if scheduler is not None:
            max_loras = max((offer.max_loras for offer in self.link.offers.values()), default=0)
            self.metrics.observe(scheduler, max_loras)


def serve_scheduler(config: SchedulerServiceConfig) -> None:
    SchedulerService(config).serve_forever()
