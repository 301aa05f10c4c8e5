"""What each service sub-command runs: the scheduler, an executor, the gateway, the whole
stack, offline generation, cache preparation. Heavy imports stay inside each command."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only by the commands that run a model
    from executor_svc.model_runner import RunnerConfig


def model_path(args: argparse.Namespace) -> Path:
    from shared.model_info import resolve_model_path

    return resolve_model_path(args.model)


def runner_config(args: argparse.Namespace) -> RunnerConfig:
    from executor_svc.model_runner import RunnerConfig

    return RunnerConfig(
        model_path=model_path(args),
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
    )


def scheduler(args: argparse.Namespace) -> None:
    from scheduler_svc.service import SchedulerService, SchedulerServiceConfig
    from shared.model_info import read_model_info, served_name

    path = model_path(args)
    info = read_model_info(path)
    SchedulerService(
        SchedulerServiceConfig(
            requests_address=args.requests_address,
            outputs_address=args.outputs_address,
            executors_address=args.executors_address,
            model=served_name(path),
            eos_token_id=info.eos_token_id,
            num_executors=args.num_executors,
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
        serve_metrics(args.metrics_port + args.rank, args.metrics_host)
    config = runner_config(args)
    serve_executor(args.executors_address, config, args.rank, served_name(config.model_path))


def gateway(args: argparse.Namespace) -> None:
    from gateway_svc.server import serve_gateway

    serve_gateway(
        model_path(args),
        args.requests_address,
        args.outputs_address,
        args.host,
        args.port,
        args.api_key or None,
        int(args.max_body_mb * 2**20),
        args.max_model_len,
    )


def serve(args: argparse.Namespace) -> None:
    from turnstile.launcher import launch

    common = [
        "--model",
        args.model,
        "--block-size",
        str(args.block_size),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--requests-address",
        args.requests_address,
        "--outputs-address",
        args.outputs_address,
        "--executors-address",
        args.executors_address,
    ]
    if args.max_model_len:
        common += ["--max-model-len", str(args.max_model_len)]
    scheduler = [
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--policy",
        args.policy,
        "--num-executors",
        str(args.num_executors),
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
        "--kv-cache-gib",
        str(args.kv_cache_gib),
        "--metrics-port",
        str(args.metrics_port + 1),
    ]
    if args.num_blocks:
        executor += ["--num-blocks", str(args.num_blocks)]
    gateway = [
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--max-body-mb",
        str(args.max_body_mb),
    ]
    if args.api_key:  # through the environment: a command line is visible to every user
        os.environ["TURNSTILE_API_KEY"] = args.api_key
    url = f"http://{args.host}:{args.port}"
    sys.exit(
        launch(common, gateway, scheduler, executor, args.num_executors, url, args.ready_timeout)
    )


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
