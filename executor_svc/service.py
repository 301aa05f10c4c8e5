"""The executor process: registers with the scheduler, then runs every plan it is sent."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from typing import NoReturn, Protocol

import zmq
from prometheus_client import Histogram

from turnstile.executor_svc.model_runner import ModelRunner
from turnstile.executor_svc.plan_applier import PlanError
from turnstile.executor_svc.runner_config import ExecutorServiceConfig
from turnstile.executor_svc.step_in_flight import PendingStep
from turnstile.executor_svc.step_watcher import StepWatcher
from turnstile.executor_svc.tensor_parallel import broke_group
from turnstile.shared.metrics_server import serve_metrics
from turnstile.shared.model_info import ModelInfo, served_name
from turnstile.shared.protocol import (
    PROTOCOL_VERSION,
    BatchPlan,
    Heartbeat,
    Register,
    RegisterReply,
    SchedulerToExecutor,
    StepFailed,
    unpack_ids,
)
from turnstile.shared.settings import REFUSED
from turnstile.shared.zmq_io import FrameCodec, make_socket, scheduler_addresses

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 60.0
HEARTBEAT_MS = 1000
FORWARD_SECONDS = Histogram(
    "turnstile:executor_forward_seconds",
    "Executor time per plan, from its start to its result (behind the step before it)",
    buckets=(1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
# rate(..._sum) is the share of wall time the executor waits for the scheduler.
IDLE_SECONDS = Histogram(
    "turnstile:executor_idle_seconds",
    "Executor time with no step running, from its last result to the next plan's start",
    buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25, 1.0, 10.0),
)
# Fault injection for the quarantine tests: a step that admits a prompt holding this token id
# fails as a kernel bug would. Never set in production.
FAULT_TOKEN_ENV = "TURNSTILE_FAULT_INJECTION_TOKEN"


class PlanRunner(Protocol):
    """What runs the plans: the model runner, or a benchmark's stand-in."""

    info: ModelInfo
    num_blocks: int
    max_model_len: int
    max_loras: int  # the LoRA adapters it keeps loaded; 0: it runs none (`Register`)
    load_seconds: float

    def launch(self, plan: BatchPlan) -> PendingStep: ...

    def reset(self, first_step: int) -> None: ...


def serve_executor(config: ExecutorServiceConfig) -> None:
    serve_metrics(config.metrics)
    try:
        runner = ModelRunner(config.runner)
    except ValueError as refusal:  # a model or setting this executor does not run, named
        log.error("%s", refusal)
        sys.exit(REFUSED)
    serve_plans(config, runner)


def serve_plans(config: ExecutorServiceConfig, runner: PlanRunner) -> None:
    """Register with the scheduler, then run every plan it sends, in order."""
    codec: FrameCodec[SchedulerToExecutor] = FrameCodec(SchedulerToExecutor, "executor.plans")
    address = scheduler_addresses(config.addresses)[1]
    socket = make_socket(zmq.Context.instance(), zmq.DEALER, address, bind=False)
    engine, rank = config.runner.engine, config.runner.executor.rank
    hello = Register(
        version=PROTOCOL_VERSION,
        rank=rank,
        model=served_name(config.runner.model_path),
        vocab_size=runner.info.vocab_size,
        num_blocks=runner.num_blocks,
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
        max_model_len=runner.max_model_len,
        max_loras=runner.max_loras,
    )
    _register(socket, codec, hello, runner)
    log.info("executor ready (%.1f s to load)", runner.load_seconds)
    StepLoop(socket, codec, rank, runner).run(hello)


class StepLoop:
    """Launches each plan as it arrives, behind the steps still running on the device, and
    answers each step as soon as it ends, in order."""

    def __init__(
        self,
        socket: zmq.Socket,
        codec: FrameCodec[SchedulerToExecutor],
        rank: int,
        runner: PlanRunner,
    ) -> None:
        self.socket, self.codec, self.rank, self.runner = socket, codec, rank, runner
        self.watcher = StepWatcher(zmq.Context.instance())
        self.poller = zmq.Poller()
        self.poller.register(socket, zmq.POLLIN)
        self.poller.register(self.watcher.bell, zmq.POLLIN)
        self.in_flight: deque[tuple[PendingStep, float]] = deque()  # with their start times
        self.answered_at: float | None = None  # when the last result left the device idle
        self.fault_token = int(os.environ.get(FAULT_TOKEN_ENV, "-1"))

    def run(self, hello: Register) -> None:
        while True:
            ready = dict(self.poller.poll(HEARTBEAT_MS))
            if not ready:
                self.socket.send(self.codec.encode(Heartbeat(self.rank)))
                continue
            if self.watcher.bell in ready:
                self.watcher.heard()
                self._answer()
            if self.socket not in ready:
                continue
            message = self.codec.decode(self.socket.recv())
            if isinstance(message, RegisterReply) and not message.accepted:
                log.warning("the scheduler does not know us (%s); registering anew", message.reason)
                self._let_steps_end(answer=False)  # their scheduler is gone
                _register(self.socket, self.codec, hello, self.runner)
                self.answered_at = None
            elif isinstance(message, BatchPlan):
                self._launch(message)

    def _launch(self, plan: BatchPlan) -> None:
        started = time.perf_counter()
        if self.in_flight:  # the device is still busy with the step before
            IDLE_SECONDS.observe(0.0)
        elif self.answered_at is not None:
            IDLE_SECONDS.observe(started - self.answered_at)
        try:
            if any(self.fault_token in unpack_ids(new.token_ids) for new in plan.new):
                raise RuntimeError(f"injected fault: token {self.fault_token} admitted")
            pending = self.runner.launch(plan)
        except PlanError as exc:
            # A plan that does not fit our batch means we missed one: nothing after it can be
            # trusted. Exit so the supervisor restarts us and the scheduler recomputes.
            sys.exit(f"lost sync with the scheduler: {exc}")
        except Exception as exc:
            self._let_steps_end(answer=True)  # the steps before ran: this one is to blame
            self._fail(plan.step, exc)
        self.in_flight.append((pending, started))
        if len(self.in_flight) == 1 and pending.done():
            self._answer()  # a device that computes at once: no thread in the way
        else:
            self.watcher.watch(pending)

    def _let_steps_end(self, answer: bool) -> None:
        """Wait until every step in flight has ended; answer them or drop them."""
        while self.in_flight:
            self.watcher.heard()
            if answer:
                self._answer()
            else:
                self.in_flight.popleft()

    def _answer(self) -> None:
        """Send the oldest step's result, which has ended."""
        pending, started = self.in_flight.popleft()
        try:
            result = pending.result()
        except Exception as exc:
            self._fail(pending.step, exc)
        FORWARD_SECONDS.observe(time.perf_counter() - started)
        if self.rank == 0:  # every rank runs the step; one answers for the group
            self.socket.send(self.codec.encode(result))
        if not self.in_flight:
            self.answered_at = time.perf_counter()

    def _fail(self, step: int, exc: Exception) -> NoReturn:
        if broke_group(exc):  # a rank died or stopped answering: not the requests' fault
            sys.exit(f"the tensor-parallel group broke at step {step}: {exc}")
        # The device's state is unknown after a failed step: say why, then start afresh.
        log.error("step %d failed", step, exc_info=exc)
        if self.rank == 0:
            self.socket.send(self.codec.encode(StepFailed(step, f"{type(exc).__name__}: {exc}")))
        self.socket.close(linger=1000)
        sys.exit(1)


def _register(
    socket: zmq.Socket, codec: FrameCodec[SchedulerToExecutor], hello: Register, runner: PlanRunner
) -> None:
    """Offer ourselves until the scheduler accepts; start a fresh batch at its next step."""
    deadline = time.monotonic() + REGISTER_TIMEOUT_S
    socket.send(codec.encode(hello))
    while time.monotonic() < deadline:
        if not socket.poll(HEARTBEAT_MS):
            continue
        reply = codec.decode(socket.recv())
        if not isinstance(reply, RegisterReply):
            continue
        if reply.accepted:
            runner.reset(reply.first_step)
            return
        if not reply.retry:
            sys.exit(f"the scheduler refused this executor: {reply.reason}")
        time.sleep(HEARTBEAT_MS / 1000 / 4)
        socket.send(codec.encode(hello))
    sys.exit("the scheduler did not answer the registration")
