"""The executor process: registers with the scheduler, then runs every plan it is sent."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Protocol

import zmq
from prometheus_client import Histogram

from turnstile.executor_svc.model_runner import ModelRunner
from turnstile.executor_svc.plan_applier import PlanError
from turnstile.executor_svc.runner_config import ExecutorServiceConfig
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
    StepResult,
    unpack_ids,
)
from turnstile.shared.zmq_io import FrameCodec, make_socket, scheduler_addresses

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 60.0
HEARTBEAT_MS = 1000
FORWARD_SECONDS = Histogram(
    "turnstile:executor_forward_seconds",
    "Executor time per plan: apply, forward, sample",
    buckets=(1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
# rate(..._sum) is the share of wall time the executor waits for the scheduler.
IDLE_SECONDS = Histogram(
    "turnstile:executor_idle_seconds",
    "Executor time from sending a result to starting the next plan",
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
    load_seconds: float

    def execute(self, plan: BatchPlan) -> StepResult: ...

    def reset(self, first_step: int) -> None: ...


def serve_executor(config: ExecutorServiceConfig) -> None:
    serve_metrics(config.metrics)
    serve_plans(config, ModelRunner(config.runner))


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
    )
    fault_token = int(os.environ.get(FAULT_TOKEN_ENV, "-1"))
    _register(socket, codec, hello, runner)
    log.info("executor ready (%.1f s to load)", runner.load_seconds)
    answered_at: float | None = None  # when the last result left
    while True:
        if not socket.poll(HEARTBEAT_MS):
            socket.send(codec.encode(Heartbeat(rank)))
            continue
        message = codec.decode(socket.recv())
        if isinstance(message, RegisterReply) and not message.accepted:
            log.warning("the scheduler does not know us (%s); registering again", message.reason)
            _register(socket, codec, hello, runner)
            answered_at = None
            continue
        if not isinstance(message, BatchPlan):
            continue
        if answered_at is not None:
            IDLE_SECONDS.observe(time.perf_counter() - answered_at)
        try:
            with FORWARD_SECONDS.time():
                if any(fault_token in unpack_ids(new.token_ids) for new in message.new):
                    raise RuntimeError(f"injected fault: token {fault_token} admitted")
                result = runner.execute(message)
        except PlanError as exc:
            # A plan that does not fit our batch means we missed one: nothing after it can be
            # trusted. Exit so the supervisor restarts us and the scheduler recomputes.
            sys.exit(f"lost sync with the scheduler: {exc}")
        except Exception as exc:
            if broke_group(exc):  # a rank died or stopped answering: not the requests' fault
                sys.exit(f"the tensor-parallel group broke at step {message.step}: {exc}")
            # The device's state is unknown after a failed step: say why, then start afresh.
            log.exception("step %d failed", message.step)
            if rank == 0:
                socket.send(codec.encode(StepFailed(message.step, f"{type(exc).__name__}: {exc}")))
            socket.close(linger=1000)
            sys.exit(1)
        if rank == 0:  # every rank runs the step; one answers for the group
            socket.send(codec.encode(result))
        answered_at = time.perf_counter()


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
