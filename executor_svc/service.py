"""The executor process: registers with the scheduler, then runs every plan it is sent."""

from __future__ import annotations

import logging
import sys

import zmq
from prometheus_client import Histogram

from executor_svc.model_runner import ModelRunner, RunnerConfig
from executor_svc.plan_applier import PlanError
from shared.protocol import (
    PROTOCOL_VERSION,
    BatchPlan,
    Register,
    RegisterReply,
    SchedulerToExecutor,
)
from shared.zmq_io import FrameCodec, make_socket

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_MS = 30_000
FORWARD_SECONDS = Histogram(
    "turnstile:executor_forward_seconds",
    "Executor time per plan: apply, forward, sample",
    buckets=(1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)


def serve_executor(scheduler_address: str, config: RunnerConfig, rank: int, model: str) -> None:
    runner = ModelRunner(config)
    codec: FrameCodec[SchedulerToExecutor] = FrameCodec(SchedulerToExecutor, "executor.plans")
    socket = make_socket(zmq.Context.instance(), zmq.DEALER, scheduler_address, bind=False)
    socket.send(
        codec.encode(
            Register(
                version=PROTOCOL_VERSION,
                rank=rank,
                model=model,
                num_blocks=runner.num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_model_len=runner.max_model_len,
            )
        )
    )
    if not socket.poll(REGISTER_TIMEOUT_MS):
        sys.exit(f"the scheduler at {scheduler_address} did not answer the registration")
    reply = codec.decode(socket.recv())
    if not isinstance(reply, RegisterReply) or not reply.accepted:
        reason = reply.reason if isinstance(reply, RegisterReply) else "no valid reply"
        sys.exit(f"the scheduler refused this executor: {reason}")
    log.info("executor rank %d ready (%.1f s to load)", rank, runner.load_seconds)
    while True:
        plan = codec.decode(socket.recv())
        if not isinstance(plan, BatchPlan):
            continue
        try:
            with FORWARD_SECONDS.time():
                result = runner.execute(plan)
        except PlanError as exc:
            # A plan that does not fit our batch means we missed one: nothing after it can be
            # trusted. Exit so the supervisor restarts us and the scheduler recomputes.
            sys.exit(f"lost sync with the scheduler: {exc}")
        if rank == 0:  # every rank runs the plan; one answer is enough
            socket.send(codec.encode(result))
