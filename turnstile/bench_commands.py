"""What each `turnstile bench` sub-command runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def scheduler(args: argparse.Namespace) -> None:
    from turnstile.bench.scheduler_bench import format_table, run

    print(format_table(run(steps=args.steps, repeats=args.repeats)))


def offline(args: argparse.Namespace) -> None:
    from turnstile.bench.offline_bench import run

    report = run(
        args.prompts, args.prompt_len, args.new_tokens, args.hf_batch, args.dtype, args.rounds
    )
    print("\n".join(report.lines()))


def step(args: argparse.Namespace) -> None:
    from turnstile.bench.step_profile import run

    for rows in args.rows:
        profile = run(
            rows, args.prompt_len, args.steps, args.dtype, args.cpu_products, args.kv_cache_dtype
        )
        print("\n".join(profile.lines()))


def parity(args: argparse.Namespace) -> None:
    from turnstile.bench.parity_bench import agreement

    for dtype, (identical, same, total) in agreement(args.new_tokens).items():
        print(
            f"{dtype}: {identical} of 9 prompts identical to HF fp32; "
            f"{same} of {total} tokens ({same / total:.1%}) before the first divergence"
        )


def quality(args: argparse.Namespace) -> None:
    from turnstile.bench.quality_bench import report

    print("\n".join(report(args.new_tokens, args.formats)))


def sampler(args: argparse.Namespace) -> None:
    from turnstile.bench.sampler_bench import measure

    for name, ms in measure(args.rows, args.vocab, args.repeats).items():
        print(f"{args.rows} rows x {args.vocab} tokens, {name}: {ms:.2f} ms (median)")


def memory(args: argparse.Namespace) -> None:
    from turnstile.bench.memory_bench import measure
    from turnstile.shared.model_info import embedded_model_path

    model = Path(args.model) if args.model else embedded_model_path()
    for quantization in args.quantization:
        f = measure(model, quantization, products=args.cpu_products)
        print(
            f"{model.name} --quantization {quantization} --cpu-products {args.cpu_products}: "
            f"resident {f.resident_bytes / 2**20:.0f}"
            f" MiB after load (anonymous peak {f.peak_bytes / 2**20:.0f} MiB), KV cache "
            f"{f.kv_bytes / 2**20:.0f} MiB, file {f.file_bytes / 2**20:.0f} MiB: "
            f"{f.ratio:.2f}x the file, the KV cache aside"
        )


def lora(args: argparse.Namespace) -> None:
    from turnstile.bench.lora_bench import measure

    for rows, cases in measure(args.rows, args.repeats).items():
        print(f"{rows} rows: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in cases.items()))


def projections(args: argparse.Namespace) -> None:
    from turnstile.bench.projection_bench import measure
    from turnstile.kernels import cpu_native

    print(f"CPU flags used: {cpu_native.best_isa()}")
    for rows, paths in measure(args.rows, args.repeats).items():
        print(f"{rows} rows: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in paths.items()))


def attention(args: argparse.Namespace) -> None:
    from turnstile.bench import attention_bench, prefill_attention_bench
    from turnstile.executor_svc.backend import KV_DTYPES

    cache = KV_DTYPES[args.kv_cache_dtype]
    if args.prefill:  # rows against the reference
        report, base = prefill_attention_bench.measure(args.repeats, cache), "reference"
    else:
        report, base = attention_bench.measure(args.repeats, cache), "rows"
    for case, paths in report.items():
        times = ", ".join(f"{path} {ms:.3g} ms" for path, ms in paths.items())
        ratios = "; ".join(f"{path} {paths[base] / ms:.1f}x" for path, ms in paths.items()
                           if path != base)  # fmt: skip
        print(f"{case}: {times}" + (f" ({ratios})" if ratios else ""))


def experts(args: argparse.Namespace) -> None:
    from turnstile.bench.experts_bench import measure

    shape = (args.experts, args.hidden, args.inner, args.top_k)
    for tokens, paths in measure(args.tokens, *shape, args.repeats, args.blocks).items():
        times = {name: ms for name, ms in paths.items() if not name.endswith(" apart")}
        line = ", ".join(f"{name} {ms:.3g} ms" for name, ms in times.items())
        ratios = ", ".join(f"{name} {times['grouped_mm'] / ms:.1f}x"
                           for name, ms in times.items() if name != "grouped_mm")  # fmt: skip
        apart = "".join(
            f", {name} {value:.1e}" for name, value in paths.items() if name not in times
        )
        print(f"{tokens} tokens: {line}" + (f" ({ratios})" if ratios else "") + apart)


def gpu(args: argparse.Namespace) -> None:
    import json

    from turnstile.bench.gpu_bench import run

    def report_to(report: dict[str, object]) -> None:
        text = json.dumps(report, indent=2)
        print(text, flush=True)
        if args.output:
            Path(args.output).write_text(text)

    run(args.sections, args.nominal_tbs, args.new_tokens, args.steps, report_to)


def startup(args: argparse.Namespace) -> None:
    from turnstile.bench.startup_bench import report

    print(report(args.runs))


def serve(args: argparse.Namespace) -> None:
    import json

    from turnstile.bench import serve_bench

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
    outcomes, duration = serve_bench.run_load(
        args.url,
        args.model,
        jobs,
        args.rate,
        args.concurrency,
        args.seed,
        burstiness=args.burstiness,
        structured=args.structured_output,
    )
    summary = serve_bench.summarize(outcomes, duration, args.slo_ttft, args.slo_tpot)
    print(json.dumps(summary, indent=2))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(serve_bench.result_record(outcomes, summary)))
    if args.plot:
        serve_bench.plot(outcomes, args.plot, f"{args.dataset}, {args.num_prompts} requests")


def compare(args: argparse.Namespace) -> None:
    import json

    from turnstile.bench.compare_bench import compare

    results = compare(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.max_num_seqs,
        args.seed,
        args.plot_prefix,
        args.rounds,
    )
    print(json.dumps(results, indent=2))


def overlap(args: argparse.Namespace) -> None:
    import json

    from turnstile.bench import overlap_bench

    for step_ms in args.step_ms:
        report = overlap_bench.simulated(step_ms, args.running, args.window, args.rounds)
        print(json.dumps(report, indent=2))
    if args.served:
        report = overlap_bench.served(
            args.num_prompts, args.input_len, args.output_len, args.rounds
        )
        print(json.dumps(report, indent=2))


def serve_vs_hf(args: argparse.Namespace) -> None:
    import json

    from turnstile.bench.serve_vs_hf import compare

    results = compare(
        args.rounds, args.num_prompts, args.input_len, args.output_len, args.hf_batch, args.seed
    )
    print(json.dumps(results, indent=2))
