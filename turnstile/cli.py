"""`turnstile <command>`: every service, the whole stack, offline generation and benchmarks.

Addresses and sizes come from flags, each with a TURNSTILE_* environment default (as compose
sets them)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

DEFAULT_BASE_PORT = 5601


def _env(name: str, default: str) -> str:
    return os.environ.get(f"TURNSTILE_{name}", default)


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=_env("MODEL", "embedded"),
        help="GGUF file or Hugging Face safetensors folder (default: the embedded SmolLM2)",
    )
    parser.add_argument("--block-size", type=int, default=int(_env("BLOCK_SIZE", "16")))
    parser.add_argument("--max-num-seqs", type=int, default=int(_env("MAX_NUM_SEQS", "128")))


def _add_addresses(parser: argparse.ArgumentParser) -> None:
    base = DEFAULT_BASE_PORT
    parser.add_argument("--requests-address", default=_env("REQUESTS", f"tcp://127.0.0.1:{base}"))
    parser.add_argument("--outputs-address", default=_env("OUTPUTS", f"tcp://127.0.0.1:{base + 1}"))
    parser.add_argument(
        "--executors-address", default=_env("EXECUTORS", f"tcp://127.0.0.1:{base + 2}")
    )


def _add_executor_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=_env("DEVICE", "cpu"), choices=["cpu", "cuda"])
    parser.add_argument(
        "--dtype", default=_env("DTYPE", "auto"), choices=["auto", "bfloat16", "float32", "float16"]
    )
    parser.add_argument("--kv-cache-gib", type=float, default=float(_env("KV_CACHE_GIB", "1.5")))
    parser.add_argument("--num-blocks", type=int, default=None, help="overrides --kv-cache-gib")


def _add_scheduler_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=int(_env("MAX_NUM_BATCHED_TOKENS", "2048"))
    )
    parser.add_argument("--policy", default=_env("POLICY", "fcfs"), choices=["fcfs", "priority"])
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--static-batching",
        action="store_true",
        help="baseline for benchmarks: admit a new batch only when the last one is done",
    )
    parser.add_argument("--num-executors", type=int, default=int(_env("NUM_EXECUTORS", "1")))
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=int(_env("MAX_WAITING", "0")) or None,
        help="refuse new requests (HTTP 429) while this many wait",
    )


def _add_gateway_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(_env("PORT", "8000")))
    parser.add_argument(
        "--api-key",
        default=_env("API_KEY", ""),
        help="require 'Authorization: Bearer KEY' on /v1/ (default: TURNSTILE_API_KEY)",
    )
    parser.add_argument("--max-body-mb", type=float, default=4.0)


def _model_path(args: argparse.Namespace) -> Path:
    from shared.model_info import resolve_model_path

    return resolve_model_path(args.model)


def _runner_config(args: argparse.Namespace):
    from executor_svc.model_runner import RunnerConfig

    return RunnerConfig(
        model_path=_model_path(args),
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        num_blocks=args.num_blocks,
    )


def _scheduler(args: argparse.Namespace) -> None:
    from scheduler_svc.service import SchedulerService, SchedulerServiceConfig
    from shared.model_info import read_model_info, served_name

    path = _model_path(args)
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
            max_model_len=info.max_model_len,
            policy=args.policy,
            enable_prefix_caching=not args.no_prefix_caching,
            static_batching=args.static_batching,
            max_waiting=args.max_waiting,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
        )
    ).serve_forever()


def _executor(args: argparse.Namespace) -> None:
    from executor_svc.service import serve_executor
    from shared.metrics_server import serve_metrics
    from shared.model_info import served_name

    if args.metrics_port is not None:
        serve_metrics(args.metrics_port + args.rank, args.metrics_host)
    config = _runner_config(args)
    serve_executor(args.executors_address, config, args.rank, served_name(config.model_path))


def _gateway(args: argparse.Namespace) -> None:
    from gateway_svc.server import serve_gateway

    serve_gateway(
        _model_path(args),
        args.requests_address,
        args.outputs_address,
        args.host,
        args.port,
        args.api_key or None,
        int(args.max_body_mb * 2**20),
    )


def _serve(args: argparse.Namespace) -> None:
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
        scheduler.append("--static-batching")
    if args.max_waiting:
        scheduler += ["--max-waiting", str(args.max_waiting)]
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


def _generate(args: argparse.Namespace) -> None:
    from turnstile.generate import generate_file

    generate_file(
        Path(args.input), Path(args.output), _runner_config(args), args.max_num_batched_tokens
    )


def _prepare(args: argparse.Namespace) -> None:
    """Build the caches a first start would otherwise build: model header, tokenizer,
    dequantized weights. Later starts only map files."""
    from executor_svc.model.weights import load_weights
    from shared.model_info import read_model_info
    from shared.tokenizer import Tokenizer

    path = _model_path(args)
    info = read_model_info(path)
    Tokenizer(path, info)
    load_weights(path, info)
    print(f"prepared {path}")


def _bench_scheduler(args: argparse.Namespace) -> None:
    from bench.scheduler_bench import format_table, run

    print(format_table(run(steps=args.steps, repeats=args.repeats)))


def _bench_offline(args: argparse.Namespace) -> None:
    from bench.offline_bench import run

    report = run(args.prompts, args.prompt_len, args.new_tokens, args.hf_batch, args.dtype)
    print("\n".join(report.lines()))


def _bench_parity(args: argparse.Namespace) -> None:
    from bench.parity_bench import agreement

    for dtype, (identical, same, total) in agreement(args.new_tokens).items():
        print(
            f"{dtype}: {identical} of 9 prompts identical to HF fp32; "
            f"{same} of {total} tokens ({same / total:.1%}) before the first divergence"
        )


def _bench_startup(args: argparse.Namespace) -> None:
    from bench.startup_bench import report

    print(report(args.runs))


def _bench_serve(args: argparse.Namespace) -> None:
    import asyncio
    import json

    from bench import serve_bench

    jobs = serve_bench.make_jobs(
        args.dataset,
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.seed,
        args.range_ratio,
        args.num_prefixes,
        args.prefix_len,
    )
    outcomes, duration = asyncio.run(
        serve_bench.run_load(args.url, args.model, jobs, args.rate, args.concurrency, args.seed)
    )
    summary = serve_bench.summarize(outcomes, duration, args.slo_ttft, args.slo_tpot)
    print(json.dumps(summary, indent=2))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(serve_bench.result_record(outcomes, summary)))
    if args.plot:
        serve_bench.plot(outcomes, args.plot, f"{args.dataset}, {args.num_prompts} requests")


def _bench_compare(args: argparse.Namespace) -> None:
    import json

    from bench.compare_bench import compare

    results = compare(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.max_num_seqs,
        args.seed,
        args.plot_prefix,
    )
    print(json.dumps(results, indent=2))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnstile", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="the whole stack on this host")
    for add in (
        _add_model, _add_addresses, _add_executor_options, _add_scheduler_options,
        _add_gateway_options,
    ):  # fmt: skip
        add(serve)
    serve.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", "9101")))
    serve.add_argument("--ready-timeout", type=float, default=300.0)
    serve.set_defaults(handler=_serve)

    scheduler = commands.add_parser("scheduler", help="the scheduler service")
    for add in (_add_model, _add_addresses, _add_scheduler_options):
        add(scheduler)
    scheduler.add_argument("--metrics-port", type=int, default=None)
    scheduler.add_argument("--metrics-host", default=_env("METRICS_HOST", "127.0.0.1"))
    scheduler.set_defaults(handler=_scheduler)

    executor = commands.add_parser("executor", help="one executor (one rank)")
    for add in (_add_model, _add_addresses, _add_executor_options):
        add(executor)
    executor.add_argument("--rank", type=int, default=int(_env("RANK", "0")))
    executor.add_argument(
        "--metrics-port", type=int, default=None, help="serves on this port + rank"
    )
    executor.add_argument("--metrics-host", default=_env("METRICS_HOST", "127.0.0.1"))
    executor.set_defaults(handler=_executor)

    gateway = commands.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    for add in (_add_model, _add_addresses, _add_gateway_options):
        add(gateway)
    gateway.set_defaults(handler=_gateway)

    generate = commands.add_parser("generate", help="offline batch generation, JSON lines")
    _add_model(generate)
    _add_executor_options(generate)
    generate.add_argument("--input", required=True, help="JSON lines: prompt or messages")
    generate.add_argument("--output", required=True)
    generate.add_argument("--max-num-batched-tokens", type=int, default=2048)
    generate.set_defaults(handler=_generate)

    prepare = commands.add_parser("prepare", help="build the model caches ahead of a start")
    _add_model(prepare)
    prepare.set_defaults(handler=_prepare)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench", required=True
    )
    bench_scheduler = bench.add_parser("scheduler", help="scheduler alone, simulated executor")
    bench_scheduler.add_argument("--steps", type=int, default=300, help="timed steps per run")
    bench_scheduler.add_argument("--repeats", type=int, default=5, help="runs per workload")
    bench_scheduler.set_defaults(handler=_bench_scheduler)
    offline = bench.add_parser("offline", help="offline throughput and latency against HF")
    offline.add_argument("--prompts", type=int, default=64)
    offline.add_argument("--prompt-len", type=int, default=128)
    offline.add_argument("--new-tokens", type=int, default=128)
    offline.add_argument("--hf-batch", type=int, default=16)
    offline.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    offline.set_defaults(handler=_bench_offline)
    serve_load = bench.add_parser("serve", help="load an OpenAI-compatible server")
    serve_load.add_argument("--url", default="http://127.0.0.1:8000")
    serve_load.add_argument("--model", default="SmolLM2-135M-Instruct")
    serve_load.add_argument(
        "--dataset", default="random", choices=["random", "longtail", "shared-prefix"]
    )
    serve_load.add_argument("--num-prompts", type=int, default=64)
    serve_load.add_argument("--input-len", type=int, default=128)
    serve_load.add_argument("--output-len", type=int, default=128)
    serve_load.add_argument("--range-ratio", type=float, default=0.0)
    serve_load.add_argument("--num-prefixes", type=int, default=4)
    serve_load.add_argument("--prefix-len", type=int, default=512)
    serve_load.add_argument(
        "--rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default: all at once)",
    )
    serve_load.add_argument("--concurrency", type=int, default=None)
    serve_load.add_argument("--seed", type=int, default=0)
    serve_load.add_argument("--slo-ttft", type=float, default=2.0, help="seconds, for goodput")
    serve_load.add_argument("--slo-tpot", type=float, default=0.2, help="seconds, for goodput")
    serve_load.add_argument("--result-json", default=None)
    serve_load.add_argument("--plot", default=None, help="PNG of latency distributions")
    serve_load.set_defaults(handler=_bench_serve)
    versus = bench.add_parser("compare", help="continuous vs static batching on longtail")
    versus.add_argument("--num-prompts", type=int, default=64)
    versus.add_argument("--input-len", type=int, default=32)
    versus.add_argument("--output-len", type=int, default=64, help="lognormal median")
    versus.add_argument("--max-num-seqs", type=int, default=16)
    versus.add_argument("--seed", type=int, default=0)
    versus.add_argument("--plot-prefix", default="", help="write PREFIX-{continuous,static}.png")
    versus.set_defaults(handler=_bench_compare)
    parity = bench.add_parser("parity", help="greedy agreement with HF, fp32 and bf16")
    parity.add_argument("--new-tokens", type=int, default=64)
    parity.set_defaults(handler=_bench_parity)
    startup = bench.add_parser("startup", help="launch to first answered request")
    startup.add_argument("--runs", type=int, default=3)
    startup.set_defaults(handler=_bench_startup)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("TURNSTILE_LOG", "INFO"),
        format=f"%(asctime)s {args.command} %(levelname)s %(name)s: %(message)s",
    )
    with contextlib.suppress(KeyboardInterrupt):
        args.handler(args)


if __name__ == "__main__":
    main(sys.argv[1:])
