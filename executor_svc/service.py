"""The executor process: registers with the scheduler, then runs every plan it is sent."""

from __future__ import annotations

import logging
import sys
import time

import zmq
from prometheus_client import Histogram

from executor_svc.model_runner import ModelRunner, RunnerConfig
from executor_svc.plan_applier import PlanError
from shared.protocol import (
    PROTOCOL_VERSION,
    BatchPlan,
    Heartbeat,
    Register,
    RegisterReply,
    SchedulerToExecutor,
)
from shared.zmq_io import FrameCodec, make_socket

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 60.0
HEARTBEAT_MS = 1000
FORWARD_SECONDS = Histogram(
    "turnstile:executor_forward_seconds",
    "Executor time per plan: apply, forward, sample",
    buckets=(1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)


def serve_executor(scheduler_address: str, config: RunnerConfig, rank: int, model: str) -> None:
    runner = ModelRunner(config)
    codec: FrameCodec[SchedulerToExecutor] = FrameCodec(SchedulerToExecutor, "executor.plans")
    socket = make_socket(zmq.Context.instance(), zmq.DEALER, scheduler_address, bind=False)
    hello = Register(
        version=PROTOCOL_VERSION,
        rank=rank,
        model=model,
        num_blocks=runner.num_blocks,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_model_len=runner.max_model_len,
    )
    _register(socket, codec, hello, runner)
    log.info("executor rank %d ready (%.1f s to load)", rank, runner.load_seconds)
    while True:
        if not socket.poll(HEARTBEAT_MS):
            socket.send(codec.encode(Heartbeat(rank)))
            continue
        message = codec.decode(socket.recv())
        if isinstance(message, RegisterReply) and not message.accepted:
            log.warning("the scheduler does not know us (%s); registering again", message.reason)
            _register(socket, codec, hello, runner)
            continue
        if not isinstance(message, BatchPlan):
            continue
        try:
            with FORWARD_SECONDS.time():
                result = runner.execute(message)
        except PlanError as exc:
            # A plan that does not fit our batch means we missed one: nothing after it can be
            # trusted. Exit so the supervisor restarts us and the scheduler recomputes.
            sys.exit(f"lost sync with the scheduler: {exc}")
        if rank == 0:  # every rank runs the plan; one answer is enough
            socket.send(codec.encode(result))


def _register(
    socket: zmq.Socket, codec: FrameCodec[SchedulerToExecutor], hello: Register, runner: ModelRunner
) -> None:
    """Offer ourselves until the scheduler answers; start a fresh batch at its next step."""
    socket.send(codec.encode(hello))
    deadline = time.monotonic() + REGISTER_TIMEOUT_S
    while time.monotonic() < deadline:
        if not socket.poll(HEARTBEAT_MS):
            continue
        reply = codec.decode(socket.recv())
        if isinstance(reply, RegisterReply):
            if not reply.accepted and "unknown" not in reply.reason:
                sys.exit(f"the scheduler refused this executor: {reply.reason}")
            if reply.accepted:
                runner.reset(reply.first_step)
                return
    sys.exit("the scheduler did not answer the registration")
