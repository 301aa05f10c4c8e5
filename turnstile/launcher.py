"""`turnstile serve`: the scheduler, the executor and the gateway as child processes of one
command, each handed its settings as a dataclass; it waits for readiness, prints the URL,
restarts a service that dies, and stops them all on Ctrl-C / SIGTERM."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import setproctitle

from turnstile.executor_svc.runner_config import (
    ExecutorConfig,
    ExecutorServiceConfig,
    RunnerConfig,
)
from turnstile.gateway_svc.config import GatewayConfig, GatewayServiceConfig
from turnstile.gateway_svc.harmony import check_parsers
from turnstile.gateway_svc.reasoning import ThinkTokens
from turnstile.scheduler_svc.service_config import AdmissionConfig, SchedulerServiceConfig
from turnstile.shared.config import (
    AddressConfig,
    EngineConfig,
    MetricsConfig,
    SchedulingConfig,
    token_budget,
    whole_prompts_refusal,
)
from turnstile.shared.lora import LoraConfig
from turnstile.shared.lora import adapters as lora_adapters
from turnstile.shared.metrics_server import SHARED_DIR_VARIABLE
from turnstile.shared.model_support import UnsupportedModel
from turnstile.shared.settings import REFUSED, nested, setting
from turnstile.shared.sharding import check_sharding
from turnstile.shared.tokenizer import served_tokenizer
from turnstile.shared.zmq_io import scheduler_addresses

MAX_RESTARTS = 5  # within RESTART_WINDOW seconds, per service; then everything stops
RESTART_WINDOW = 60.0
DRAIN_SECONDS = 65.0  # the gateway's own drain limit, plus a margin


@dataclass(slots=True, frozen=True)
class LaunchConfig:
    """The stack's start"""

    ready_timeout: float = setting(300.0, "seconds the stack may take to answer /health")


@dataclass(slots=True, frozen=True)
class ServeConfig:
    engine: EngineConfig = nested(EngineConfig)
    addresses: AddressConfig = nested(AddressConfig)
    scheduling: SchedulingConfig = nested(SchedulingConfig)
    admission: AdmissionConfig = nested(AdmissionConfig)
    executor: ExecutorConfig = nested(ExecutorConfig)
    gateway: GatewayConfig = nested(GatewayConfig)
    lora: LoraConfig = nested(LoraConfig)
    metrics: MetricsConfig = nested(MetricsConfig)
    launch: LaunchConfig = nested(LaunchConfig)


# Each service's entry point, "module:function": imported by the process that runs it alone, so
# `serve` itself never loads torch.
ENTRY_POINTS = {
    "scheduler": "turnstile.scheduler_svc.service:serve_scheduler",
    "executor": "turnstile.executor_svc.service:serve_executor",
    "gateway": "turnstile.gateway_svc.server:serve_gateway",
}


@dataclass(slots=True, frozen=True)
class Service:
    name: str  # in ENTRY_POINTS
    config: Any  # what its entry point takes
    title: str = ""  # for ps; the name where empty
    # Services that live and die together: tensor-parallel ranks, whose survivors cannot go on
    # without the one that died.
    group: str = ""


def run_service(service: Service) -> None:
    module, _, function = ENTRY_POINTS[service.name].partition(":")
    getattr(importlib.import_module(module), function)(service.config)


def stack(config: ServeConfig, run_dir: Path) -> list[Service]:
    """The three services of one stack, their sockets in `run_dir` unless set."""
    addresses = AddressConfig(*scheduler_addresses(config.addresses, run_dir))
    metrics = config.metrics
    executor_metrics = metrics
    if metrics.metrics_port is not None:
        executor_metrics = dataclasses.replace(metrics, metrics_port=metrics.metrics_port + 1)
    scheduler = SchedulerServiceConfig(
        config.engine, addresses, config.scheduling, config.admission, metrics
    )
    ranks = config.engine.tensor_parallel_size
    meet = f"tcp://127.0.0.1:{free_port()}" if ranks > 1 else "unused"
    executors = []
    for rank in range(ranks):
        executor = dataclasses.replace(config.executor, rank=rank, distributed_init_method=meet)
        runner = RunnerConfig(config.engine, executor, config.lora)
        port = executor_metrics.metrics_port
        own = executor_metrics if port is None else dataclasses.replace(
            executor_metrics, metrics_port=port + rank)  # fmt: skip
        executors.append(Service("executor", ExecutorServiceConfig(runner, addresses, own),
                                 "executor" if rank == 0 else f"executor {rank}",
                                 "executors" if ranks > 1 else ""))  # fmt: skip
    return [
        Service("scheduler", scheduler),
        *executors,
        Service(
            "gateway", GatewayServiceConfig(config.engine, addresses, config.gateway, config.lora)
        ),
    ]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def configure_logging(name: str) -> None:
    logging.basicConfig(
        level=os.environ.get("TURNSTILE_LOG", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )


def _child(service: Service) -> None:
    setproctitle.setproctitle(f"turnstile {service.title or service.name}")  # for ps
    configure_logging(service.name)
    with contextlib.suppress(KeyboardInterrupt):
        run_service(service)


def _start(service: Service) -> BaseProcess:
    # spawn, not fork: a fresh interpreter per service, as a separate command would have.
    process = multiprocessing.get_context("spawn").Process(
        target=_child, args=(service,), name=f"turnstile-{service.name}"
    )
    process.start()
    return process


def serve(config: ServeConfig) -> None:
    try:  # a model the executor would run wrongly stops here, before any service starts
        info = config.engine.model_info()
        context = min(config.engine.max_model_len or info.max_model_len, info.max_model_len)
        given, seqs = config.scheduling.max_num_batched_tokens, config.engine.max_num_seqs
        budget = token_budget(given, context, info.encoder_only)
        if budget < seqs:  # else the scheduler would refuse it once an executor registers
            raise ValueError(
                f"--max-num-batched-tokens ({budget}) must be at least --max-num-seqs ({seqs}): "
                "each decode computes a token a step"
            )
        if info.encoder_only and budget < context:
            raise ValueError(whole_prompts_refusal(budget, context))
        check_sharding(info, config.engine.tensor_parallel_size)
        lora_adapters(config.lora, info)  # each one checked
        gateway = config.gateway
        check_parsers(info, gateway.tool_call_parser, gateway.reasoning_parser)
        gateway.ssl_context()  # its files readable and fitting
        parser = gateway.reasoning_parser if not info.chat_format else None
        if parser or config.engine.tokenizer is not None:  # a vocabulary the model embeds
            tokenizer = served_tokenizer(config.engine, info)
            if parser:  # its markers in that vocabulary
                ThinkTokens.of(tokenizer, parser)
    except (UnsupportedModel, FileNotFoundError, ValueError) as exc:
        sys.exit(f"turnstile: {exc}")
    # A directory of its own (mkdtemp makes it 0700): no other local user reaches the sockets,
    # and several stacks on one host never meet.
    run_dir = Path(tempfile.mkdtemp(prefix="turnstile-"))
    (run_dir / "metrics").mkdir()
    os.environ[SHARED_DIR_VARIABLE] = str(run_dir / "metrics")  # the children inherit it
    url = f"{config.gateway.scheme}://{config.gateway.host}:{config.gateway.port}"
    try:
        code = supervise(stack(config, run_dir), url, config.launch.ready_timeout)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    sys.exit(code)


def supervise(stack: list[Service], url: str, ready_timeout: float) -> int:
    """Start everything, wait for /health, then supervise: a service that dies is started
    again (the scheduler re-queues the work of a lost executor), until a signal arrives.
    The gateway comes last in `stack`."""
    children = [_start(service) for service in stack]
    restarts: list[list[float]] = [[] for _ in stack]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    wake, woken = socket.socketpair()  # a signal writes a byte: the wait below ends at once
    wake.setblocking(False)
    signal.set_wakeup_fd(wake.fileno())
    started = time.monotonic()
    announced = False
    code = 0
    while not stopping:
        for index, child in enumerate(children):
            if child.exitcode is None:
                continue
            now = time.monotonic()
            restarts[index] = [t for t in restarts[index] if now - t < RESTART_WINDOW] + [now]
            name = stack[index].title or stack[index].name
            if len(restarts[index]) > MAX_RESTARTS or child.exitcode == REFUSED:
                why = "refused its settings" if child.exitcode == REFUSED else "keeps dying"
                print(f"turnstile: {name} {why}; stopping", file=sys.stderr)
                stopping, code = True, 1
                break
            print(f"turnstile: {name} exited ({child.exitcode}); restarting", file=sys.stderr)
            group = stack[index].group
            for other, service in enumerate(stack):  # the rest of its group goes down with it
                if group and service.group == group and other != index:
                    children[other].kill()
                    children[other].join()
                    children[other] = _start(service)
            children[index] = _start(stack[index])
        if not announced and not stopping:
            if healthy(url):
                ready_in = time.monotonic() - started
                print(f"Turnstile is serving at {url} (ready in {ready_in:.1f} s)", flush=True)
                announced = True
            elif time.monotonic() - started > ready_timeout:
                print("turnstile: not ready in time; stopping", file=sys.stderr)
                code = 1
                break
        # until a child exits or a signal comes, at most a readiness check's interval
        wait([*(child.sentinel for child in children), woken], timeout=0.2)
        with contextlib.suppress(BlockingIOError):
            woken.recv(64, socket.MSG_DONTWAIT)
    signal.set_wakeup_fd(-1)
    wake.close()
    woken.close()
    _stop(children)
    return code


def _stop(children: list[BaseProcess]) -> None:
    # The gateway goes first and drains: requests under way finish while the scheduler and the
    # executors still run; then the rest stop.
    gateway = children[-1]
    if gateway.exitcode is None:
        gateway.terminate()
        gateway.join(DRAIN_SECONDS)
        if gateway.exitcode is None:
            gateway.kill()
    for child in children:
        if child.exitcode is None:
            child.terminate()
    deadline = time.monotonic() + 10
    for child in children:
        child.join(max(deadline - time.monotonic(), 0.1))
        if child.exitcode is None:
            child.kill()
            child.join()


def healthy(url: str) -> bool:
    context = None
    if url.startswith("https:"):  # our own server: its certificate may name another host
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1, context=context) as response:
            return response.status == 200
    except OSError:
        return False
