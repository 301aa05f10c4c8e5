"""What each service sub-command runs: the scheduler, an executor, the gateway, the whole
stack, offline generation, cache preparation. Heavy imports stay inside each command."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only by the commands that run a model
    from executor_svc.runner_config import RunnerConfig


def model_path(args: argparse.Namespace) -> Path:
    from shared.model_info import resolve_model_path

    return resolve_model_path(args.model)


def addresses(args: argparse.Namespace, run_dir: Path | None = None) -> tuple[str, str]:
    """The scheduler's two addresses: as given, else IPC paths in `run_dir` (by default the
    host's private run directory)."""
    from shared.zmq_io import default_run_dir, ipc_address

    where = run_dir or default_run_dir()
    return (
        args.scheduler_address or ipc_address(where, "scheduler.sock"),
        args.executors_address or ipc_address(where, "executors.sock"),
    )


def runner_config(args: argparse.Namespace) -> RunnerConfig:
    from executor_svc.runner_config import RunnerConfig

    return RunnerConfig(
        model_path=model_path(args),
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        backend=args.backend,
        enforce_eager=args.enforce_eager,
    )


def scheduler(args: argparse.Namespace) -> None:
    from scheduler_svc.service import SchedulerService
    from scheduler_svc.service_config import SchedulerServiceConfig
    from shared.model_info import read_model_info, served_name

    path = model_path(args)
    info = read_model_info(path)
    gateway_address, executors_address = addresses(args)
    SchedulerService(
        SchedulerServiceConfig(
            gateway_address=gateway_address,
            executors_address=executors_address,
            model=served_name(path),
            eos_token_id=info.eos_token_id,
            vocab_size=info.vocab_size,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=min(args.max_model_len or info.max_model_len, info.max_model_len),
            policy=args.policy,
            enable_prefix_caching=not args.no_prefix_caching,
            static_batching=args.static_batching,
            static_fill_timeout=args.static_fill_timeout,
            max_waiting=args.max_waiting,
            queue_timeout=args.queue_timeout,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
        )
    ).serve_forever()


def executor(args: argparse.Namespace) -> None:
    from executor_svc.service import serve_executor
    from shared.metrics_server import serve_metrics
    from shared.model_info import served_name

    if args.metrics_port is not None:
        serve_metrics(args.metrics_port, args.metrics_host)
    config = runner_config(args)
    serve_executor(addresses(args)[1], config, served_name(config.model_path))


def gateway(args: argparse.Namespace) -> None:
    from gateway_svc.server import serve_gateway

    serve_gateway(
        model_path(args),
        addresses(args)[0],
        args.host,
        args.port,
        args.api_key or None,
        int(args.max_body_mb * 2**20),
        args.max_model_len,
        args.request_timeout,
    )


def serve(args: argparse.Namespace) -> None:
    import shutil
    import tempfile

    from turnstile.launcher import launch

    # A directory of its own (mkdtemp makes it 0700): no other local user reaches the sockets,
    # and several stacks on one host never meet.
    run_dir = Path(tempfile.mkdtemp(prefix="turnstile-"))
    scheduler_address, executors_address = addresses(args, run_dir)
    common = [
        "--model",
        args.model,
        "--block-size",
        str(args.block_size),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--scheduler-address",
        scheduler_address,
        "--executors-address",
        executors_address,
    ]
    if args.max_model_len:
        common += ["--max-model-len", str(args.max_model_len)]
    scheduler = [
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--policy",
        args.policy,
        "--metrics-port",
        str(args.metrics_port),
    ]
    if args.no_prefix_caching:
        scheduler.append("--no-prefix-caching")
    if args.static_batching:
        scheduler += ["--static-batching", args.static_batching]
        scheduler += ["--static-fill-timeout", str(args.static_fill_timeout)]
    if args.max_waiting:
        scheduler += ["--max-waiting", str(args.max_waiting)]
    if args.queue_timeout:
        scheduler += ["--queue-timeout", str(args.queue_timeout)]
    executor = [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--backend",
        args.backend,
        "--kv-cache-gib",
        str(args.kv_cache_gib),
        "--metrics-port",
        str(args.metrics_port + 1),
    ]
    if args.num_blocks:
        executor += ["--num-blocks", str(args.num_blocks)]
    if args.enforce_eager:
        executor.append("--enforce-eager")
    gateway = [
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--max-body-mb",
        str(args.max_body_mb),
        "--request-timeout",
        str(args.request_timeout),
    ]
    if args.api_key:  # through the environment: a command line is visible to every user
        os.environ["TURNSTILE_API_KEY"] = args.api_key
    url = f"http://{args.host}:{args.port}"
    try:
        code = launch(common, gateway, scheduler, executor, url, args.ready_timeout)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    sys.exit(code)


def generate(args: argparse.Namespace) -> None:
    from turnstile.generate import generate_file

    generate_file(
        Path(args.input), Path(args.output), runner_config(args), args.max_num_batched_tokens
    )


def prepare(args: argparse.Namespace) -> None:
    """Build the caches a first start would otherwise build: model header, tokenizer,
    dequantized weights, the native CPU kernels. Later starts only map files."""
    from executor_svc.model.weights import load_weights
    from kernels import cpu_native
    from shared.model_info import read_model_info
    from shared.tokenizer import Tokenizer

    path = model_path(args)
    info = read_model_info(path)
    Tokenizer(path, info)
    load_weights(path, info)
    native = cpu_native.library()
    print(f"prepared {path}; native CPU kernels: {'built' if native else 'unavailable'}")


def keygen(_: argparse.Namespace) -> None:
    """Print a secret key; give every service the same one to encrypt and authenticate their
    ZeroMQ links (a cross-host deployment should)."""
    import zmq

    print(zmq.curve_keypair()[1].decode())
