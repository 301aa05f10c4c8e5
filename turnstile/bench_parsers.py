"""`turnstile bench <name>`: each benchmark's parameters, and the function that runs it."""

from __future__ import annotations

import argparse
import typing

from turnstile.bench_commands import (
    attention,
    compare,
    experts,
    gpu,
    lora,
    memory,
    offline,
    overlap,
    parity,
    projections,
    quality,
    sampler,
    scheduler,
    serve,
    serve_vs_hf,
    startup,
    step,
)
from turnstile.executor_svc.runner_config import ExecutorConfig


def executor_choices(name: str) -> tuple[str, ...]:
    """An executor setting's choices, as `turnstile serve` takes them."""
    return typing.get_args(typing.get_type_hints(ExecutorConfig)[name])


CPU_PRODUCTS = executor_choices("cpu_products")
KV_CACHE_DTYPES = executor_choices("kv_cache_dtype")
TILES_CACHES = ("bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")  # the caches AMX tiles read


def add_random_workload(command: argparse.ArgumentParser) -> None:
    """The random prompts a served benchmark sends: how many, tokens in and out."""
    command.add_argument("--num-prompts", type=int, default=64)
    command.add_argument("--input-len", type=int, default=128)
    command.add_argument("--output-len", type=int, default=128)


def add_parsers(parser: argparse.ArgumentParser) -> None:
    """`turnstile bench <name>`: each benchmark's parameters."""
    bench = parser.add_subparsers(dest="bench", required=True)
    command = bench.add_parser("scheduler", help="scheduler alone, simulated executor")
    command.add_argument("--steps", type=int, default=300, help="timed steps per run")
    command.add_argument("--repeats", type=int, default=5, help="runs per workload")
    command.set_defaults(handler=scheduler)
    command = bench.add_parser("offline", help="offline throughput and latency against HF")
    command.add_argument("--prompts", type=int, default=64)
    command.add_argument("--prompt-len", type=int, default=128)
    command.add_argument("--new-tokens", type=int, default=128)
    command.add_argument("--hf-batch", type=int, default=16)
    command.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
        help="auto: the server's defaults (GGUF blocks kept quantized); a dtype: dequantized",
    )  # fmt: skip
    command.add_argument("--rounds", type=int, default=1, help="repeat; medians are reported")
    command.set_defaults(handler=offline)
    command = bench.add_parser("step", help="where a decode step's time goes (torch.profiler)")
    command.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    command.add_argument("--prompt-len", type=int, default=128)
    command.add_argument("--steps", type=int, default=10, help="timed and profiled steps, each")
    command.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    command.add_argument("--cpu-products", default="auto", choices=CPU_PRODUCTS)
    command.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    command.set_defaults(handler=step)
    command = bench.add_parser("serve", help="load an OpenAI-compatible server")
    command.add_argument("--url", default="http://127.0.0.1:8000")
    command.add_argument("--model", default="SmolLM2-135M-Instruct")
    command.add_argument(
        "--dataset", default="random", choices=["random", "longtail", "shared-prefix"]
    )
    add_random_workload(command)
    command.add_argument("--range-ratio", type=float, default=0.0)
    command.add_argument("--num-prefixes", type=int, default=4)
    command.add_argument("--prefix-len", type=int, default=512)
    command.add_argument("--rate", type=float, default=float("inf"),
                         help="arrivals per second (default: all at once)")  # fmt: skip
    command.add_argument("--burstiness", type=float, default=1.0, help="the gaps' gamma "
                         "shape: 1 Poisson, <1 burstier, inf evenly spaced")  # fmt: skip
    command.add_argument("--concurrency", type=int, default=None)
    command.add_argument(
        "--structured-output",
        action="store_true",
        help="every answer constrained to a JSON schema (a list of items without end)",
    )
    command.add_argument("--seed", type=int, default=0)
    command.add_argument("--slo-ttft", type=float, default=2.0, help="seconds, for goodput")
    command.add_argument("--slo-tpot", type=float, default=0.2, help="seconds, for goodput")
    command.add_argument("--result-json", default=None)
    command.add_argument("--plot", default=None, help="PNG of latency distributions")
    command.set_defaults(handler=serve)
    command = bench.add_parser("compare", help="continuous vs static batching on longtail")
    command.add_argument(
        "--num-prompts",
        type=int,
        default=128,
        help="with fewer, the run's end (the batch draining, nothing left to admit) dominates",
    )
    command.add_argument("--input-len", type=int, default=32)
    command.add_argument("--output-len", type=int, default=64, help="lognormal median")
    command.add_argument("--max-num-seqs", type=int, default=16)
    command.add_argument("--seed", type=int, default=0)
    command.add_argument("--rounds", type=int, default=1, help="repeat; medians are reported")
    command.add_argument(
        "--plot-prefix", default="", help="write PREFIX-{continuous,padded,compact}.png"
    )
    command.set_defaults(handler=compare)
    command = bench.add_parser(
        "serve-vs-hf", help="our server on random prompts next to HF generate, repeated"
    )
    command.add_argument("--rounds", type=int, default=3)
    add_random_workload(command)
    command.add_argument("--hf-batch", type=int, default=16)
    command.add_argument("--seed", type=int, default=0)
    command.set_defaults(handler=serve_vs_hf)
    command = bench.add_parser(
        "overlap", help="async scheduling against lockstep: simulated steps, then served"
    )
    command.add_argument(
        "--step-ms", type=float, nargs="*", default=[2.0, 10.0], help="none: served only"
    )
    command.add_argument("--running", type=int, default=256, help="requests decoding at once")
    command.add_argument("--window", type=float, default=3.0, help="seconds counted per run")
    command.add_argument("--rounds", type=int, default=3, help="each mode, alternated")
    command.add_argument("--served", action="store_true", help="also the real stack, served")
    add_random_workload(command)
    command.set_defaults(handler=overlap)
    command = bench.add_parser("parity", help="greedy agreement with HF, fp32 and bf16")
    command.add_argument("--new-tokens", type=int, default=64)
    command.set_defaults(handler=parity)
    command = bench.add_parser(
        "projections", help="the model's layer products per native path: bf16, Q4_1, int8 tiles"
    )
    command.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    command.add_argument("--repeats", type=int, default=7)
    command.set_defaults(handler=projections)
    command = bench.add_parser(
        "attention", help="a layer's attention over a bf16 cache: float32 rows, AMX tiles"
    )
    command.add_argument("--repeats", type=int, default=15)
    command.add_argument("--kv-cache-dtype", default="bfloat16",
                         choices=(*TILES_CACHES, "float32"))  # fmt: skip
    command.add_argument("--prefill", action="store_true",
                         help="prompt chunks: the torch reference against rows")  # fmt: skip
    command.set_defaults(handler=attention)
    command = bench.add_parser(
        "experts", help="a layer of experts: torch's grouped matmuls, AMX-BF16 tiles, GGUF blocks"
    )
    command.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512, 4096])
    for name, default in (("experts", 16), ("hidden", 512), ("inner", 512), ("top-k", 4)):
        command.add_argument(f"--{name}", type=int, default=default)
    command.add_argument("--repeats", type=int, default=7)
    command.add_argument("--blocks", choices=["q4_k_m", "mxfp4"], default="",
                         help="also the experts in these blocks (mxfp4: the bf16 paths on their "
                              "values)")  # fmt: skip
    command.set_defaults(handler=experts)
    command = bench.add_parser("lora", help="a LoRA adapter's cost to a decode step, offline")
    command.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    command.add_argument("--repeats", type=int, default=5)
    command.set_defaults(handler=lora)
    command = bench.add_parser("memory", help="resident memory after load against the file")
    command.add_argument("--model", help="a GGUF file or model folder (default: the embedded)")
    command.add_argument("--quantization", nargs="+", default=["gguf", "none"])
    command.add_argument("--cpu-products", default="auto", choices=CPU_PRODUCTS)
    command.set_defaults(handler=memory)
    command = bench.add_parser(
        "quality", help="each weight format against float32: greedy agreement, perplexity"
    )
    command.add_argument("--new-tokens", type=int, default=64)
    command.add_argument(
        "--formats", nargs="*", default=["Q4_0", "Q8_0", "Q4_K", "Q6_K"],
        help="block types to store the embedded model's layers in again and measure too",
    )  # fmt: skip
    command.set_defaults(handler=quality)
    command = bench.add_parser("sampler", help="a step's random draw: torch's and the native race")
    command.add_argument("--rows", type=int, default=64)
    command.add_argument("--vocab", type=int, default=49_152)
    command.add_argument("--repeats", type=int, default=20)
    command.set_defaults(handler=sampler)
    command = bench.add_parser(
        "gpu", help="the CUDA backend on this GPU: HF parity, speed, roofline, a served run"
    )
    command.add_argument(
        "--nominal-tbs", type=float, default=4.8, help="the GPU's memory bandwidth (H200: 4.8)"
    )
    command.add_argument("--new-tokens", type=int, default=64, help="parity: tokens per prompt")
    command.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    command.add_argument(
        "--sections", nargs="+", metavar="NAME",
        help="only these sections, by their names in the report (an unknown name lists them); "
        "default: all",
    )  # fmt: skip
    command.add_argument("--output", help="the report as JSON, rewritten as each section ends")
    command.set_defaults(handler=gpu)
    command = bench.add_parser("startup", help="launch to first answered request")
    command.add_argument("--runs", type=int, default=3)
    command.set_defaults(handler=startup)
