"""What each `turnstile bench` sub-command runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def scheduler(args: argparse.Namespace) -> None:
    from bench.scheduler_bench import format_table, run

    print(format_table(run(steps=args.steps, repeats=args.repeats)))


def offline(args: argparse.Namespace) -> None:
    from bench.offline_bench import run

    report = run(
        args.prompts, args.prompt_len, args.new_tokens, args.hf_batch, args.dtype, args.rounds
    )
    print("\n".join(report.lines()))


def step(args: argparse.Namespace) -> None:
    from bench.step_profile import run

    for rows in args.rows:
        print("\n".join(run(rows, args.prompt_len, args.steps, args.dtype).lines()))


def parity(args: argparse.Namespace) -> None:
    from bench.parity_bench import agreement

    for dtype, (identical, same, total) in agreement(args.new_tokens).items():
        print(
            f"{dtype}: {identical} of 9 prompts identical to HF fp32; "
            f"{same} of {total} tokens ({same / total:.1%}) before the first divergence"
        )


def gpu(args: argparse.Namespace) -> None:
    import json

    from bench.gpu_bench import run

    print(json.dumps(run(args.nominal_tbs, args.new_tokens, args.steps), indent=2))


def startup(args: argparse.Namespace) -> None:
    from bench.startup_bench import report

    print(report(args.runs))


def serve(args: argparse.Namespace) -> None:
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
    outcomes, duration = serve_bench.run_load(
        args.url,
        args.model,
        jobs,
        args.rate,
        args.concurrency,
        args.seed,
        burstiness=args.burstiness,
    )
    summary = serve_bench.summarize(outcomes, duration, args.slo_ttft, args.slo_tpot)
    print(json.dumps(summary, indent=2))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(serve_bench.result_record(outcomes, summary)))
    if args.plot:
        serve_bench.plot(outcomes, args.plot, f"{args.dataset}, {args.num_prompts} requests")


def compare(args: argparse.Namespace) -> None:
    import json

    from bench.compare_bench import compare

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


def serve_vs_hf(args: argparse.Namespace) -> None:
    import json

    from bench.serve_vs_hf import compare

    results = compare(
        args.rounds, args.num_prompts, args.input_len, args.output_len, args.hf_batch, args.seed
    )
    print(json.dumps(results, indent=2))
