"""`turnstile <command>`: every service, the whole stack, offline generation and benchmarks.

Addresses and sizes come from flags, each with a TURNSTILE_* environment default (as compose
sets them)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from turnstile import bench_commands, services


def _env(name: str, default: str) -> str:
    return os.environ.get(f"TURNSTILE_{name}", default)


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=_env("MODEL", "embedded"),
        help="GGUF file or Hugging Face safetensors folder (default: the embedded SmolLM2)",
    )
    parser.add_argument("--block-size", type=int, default=int(_env("BLOCK_SIZE", "16")))
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=int(_env("MAX_MODEL_LEN", "0")) or None,
        help="context length to serve (default: the model's)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=int(_env("MAX_NUM_SEQS", "128")))


def _add_addresses(parser: argparse.ArgumentParser) -> None:
    where = "ipc:// in a private 0700 directory (serve: a new one; otherwise $TURNSTILE_RUN_DIR"
    where += ", else $XDG_RUNTIME_DIR/turnstile, else /tmp/turnstile-UID); tcp:// across hosts"
    parser.add_argument(
        "--scheduler-address",
        default=os.environ.get("TURNSTILE_SCHEDULER"),
        help=f"gateways reach the scheduler here (default: {where})",
    )
    parser.add_argument(
        "--executors-address",
        default=os.environ.get("TURNSTILE_EXECUTORS"),
        help="executors reach the scheduler here (default: as --scheduler-address)",
    )


def _add_executor_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=_env("DEVICE", "cpu"), choices=["cpu", "cuda"])
    parser.add_argument(
        "--dtype", default=_env("DTYPE", "auto"), choices=["auto", "bfloat16", "float32", "float16"]
    )
    parser.add_argument(
        "--backend",
        default=_env("BACKEND", "auto"),
        choices=["auto", "cpu", "torch", "cuda"],
        help="auto: cuda on a GPU; on a CPU the native kernels where they run, else torch "
        "(the plain-torch reference)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        default=_env("ENFORCE_EAGER", "") == "1",
        help="cuda: run decode steps eagerly instead of replaying CUDA graphs",
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
        choices=["padded", "compact"],
        help="baseline for benchmarks: admit a new batch only when the last one is done; "
        "padded: finished rows compute until the batch ends (as HF generate); compact: they leave",
    )
    parser.add_argument(
        "--static-fill-timeout",
        type=float,
        default=1.0,
        help="static batching: open a batch once it is full or its first request has waited "
        "this many seconds",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=int(_env("MAX_WAITING", "0")) or None,
        help="refuse new requests (HTTP 429) while this many wait",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=float(_env("QUEUE_TIMEOUT", "0")) or None,
        help="seconds a request may wait to start before it is refused (HTTP 429)",
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
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=float(_env("REQUEST_TIMEOUT", "1800")),
        help="seconds after which a request still running is ended with an error (HTTP 504)",
    )


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
    serve.set_defaults(handler=services.serve)

    scheduler = commands.add_parser("scheduler", help="the scheduler service")
    for add in (_add_model, _add_addresses, _add_scheduler_options):
        add(scheduler)
    scheduler.add_argument("--metrics-port", type=int, default=None)
    scheduler.add_argument("--metrics-host", default=_env("METRICS_HOST", "127.0.0.1"))
    scheduler.set_defaults(handler=services.scheduler)

    executor = commands.add_parser("executor", help="the executor: the model on its device")
    for add in (_add_model, _add_addresses, _add_executor_options):
        add(executor)
    executor.add_argument("--metrics-port", type=int, default=None)
    executor.add_argument("--metrics-host", default=_env("METRICS_HOST", "127.0.0.1"))
    executor.set_defaults(handler=services.executor)

    gateway = commands.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    for add in (_add_model, _add_addresses, _add_gateway_options):
        add(gateway)
    gateway.set_defaults(handler=services.gateway)

    generate = commands.add_parser("generate", help="offline batch generation, JSON lines")
    _add_model(generate)
    _add_executor_options(generate)
    generate.add_argument("--input", required=True, help="JSON lines: prompt or messages")
    generate.add_argument("--output", required=True)
    generate.add_argument("--max-num-batched-tokens", type=int, default=2048)
    generate.set_defaults(handler=services.generate)

    prepare = commands.add_parser("prepare", help="build the model caches ahead of a start")
    _add_model(prepare)
    prepare.set_defaults(handler=services.prepare)

    keygen = commands.add_parser(
        "keygen", help="a ZeroMQ CURVE secret key for TURNSTILE_CURVE_SECRET_KEY"
    )
    keygen.set_defaults(handler=services.keygen)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench", required=True
    )
    bench_scheduler = bench.add_parser("scheduler", help="scheduler alone, simulated executor")
    bench_scheduler.add_argument("--steps", type=int, default=300, help="timed steps per run")
    bench_scheduler.add_argument("--repeats", type=int, default=5, help="runs per workload")
    bench_scheduler.set_defaults(handler=bench_commands.scheduler)
    offline = bench.add_parser("offline", help="offline throughput and latency against HF")
    offline.add_argument("--prompts", type=int, default=64)
    offline.add_argument("--prompt-len", type=int, default=128)
    offline.add_argument("--new-tokens", type=int, default=128)
    offline.add_argument("--hf-batch", type=int, default=16)
    offline.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    offline.add_argument("--rounds", type=int, default=1, help="repeat; medians are reported")
    offline.set_defaults(handler=bench_commands.offline)
    step = bench.add_parser("step", help="where a decode step's time goes (torch.profiler)")
    step.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    step.add_argument("--prompt-len", type=int, default=128)
    step.add_argument("--steps", type=int, default=10, help="timed and profiled steps, each")
    step.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    step.set_defaults(handler=bench_commands.step)
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
        help="arrivals per second (default: all at once)",
    )
    serve_load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma-distributed gaps: 1 Poisson, <1 burstier, inf evenly spaced",
    )
    serve_load.add_argument("--concurrency", type=int, default=None)
    serve_load.add_argument("--seed", type=int, default=0)
    serve_load.add_argument("--slo-ttft", type=float, default=2.0, help="seconds, for goodput")
    serve_load.add_argument("--slo-tpot", type=float, default=0.2, help="seconds, for goodput")
    serve_load.add_argument("--result-json", default=None)
    serve_load.add_argument("--plot", default=None, help="PNG of latency distributions")
    serve_load.set_defaults(handler=bench_commands.serve)
    versus = bench.add_parser("compare", help="continuous vs static batching on longtail")
    versus.add_argument(
        "--num-prompts",
        type=int,
        default=128,
        help="with fewer, the run's end (the batch draining, nothing left to admit) dominates",
    )
    versus.add_argument("--input-len", type=int, default=32)
    versus.add_argument("--output-len", type=int, default=64, help="lognormal median")
    versus.add_argument("--max-num-seqs", type=int, default=16)
    versus.add_argument("--seed", type=int, default=0)
    versus.add_argument("--rounds", type=int, default=1, help="repeat; medians are reported")
    versus.add_argument(
        "--plot-prefix", default="", help="write PREFIX-{continuous,padded,compact}.png"
    )
    versus.set_defaults(handler=bench_commands.compare)
    versus_hf = bench.add_parser(
        "serve-vs-hf", help="our server on random prompts next to HF generate, repeated"
    )
    versus_hf.add_argument("--rounds", type=int, default=3)
    versus_hf.add_argument("--num-prompts", type=int, default=64)
    versus_hf.add_argument("--input-len", type=int, default=128)
    versus_hf.add_argument("--output-len", type=int, default=128)
    versus_hf.add_argument("--hf-batch", type=int, default=16)
    versus_hf.add_argument("--seed", type=int, default=0)
    versus_hf.set_defaults(handler=bench_commands.serve_vs_hf)
    parity = bench.add_parser("parity", help="greedy agreement with HF, fp32 and bf16")
    parity.add_argument("--new-tokens", type=int, default=64)
    parity.set_defaults(handler=bench_commands.parity)
    gpu = bench.add_parser(
        "gpu", help="the CUDA backend on this GPU: HF parity, speed, roofline, a served run"
    )
    gpu.add_argument(
        "--nominal-tbs", type=float, default=4.8, help="the GPU's memory bandwidth (H200: 4.8)"
    )
    gpu.add_argument("--new-tokens", type=int, default=64, help="parity: tokens per prompt")
    gpu.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    gpu.set_defaults(handler=bench_commands.gpu)
    startup = bench.add_parser("startup", help="launch to first answered request")
    startup.add_argument("--runs", type=int, default=3)
    startup.set_defaults(handler=bench_commands.startup)
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
