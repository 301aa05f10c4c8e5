"""`turnstile bench compare`: continuous against static batching in our own engine, on the
same long-tailed requests in one run, next to the ideal ratio.

Static batching admits a batch of --max-num-seqs requests only when the previous batch has
finished, so each batch costs as many steps as its longest request. If a step cost the same
whatever its batch, continuous batching would win by padded / useful tokens: the ideal ratio.
"""

from __future__ import annotations

import asyncio

from bench.serve_bench import Job, Outcome, make_jobs, plot, run_load, summarize
from bench.server_process import launched_server


def ideal_ratio(jobs: list[Job], batch: int) -> float:
    useful = sum(job.output_len for job in jobs)
    padded = sum(
        len(jobs[i : i + batch]) * max(job.output_len for job in jobs[i : i + batch])
        for i in range(0, len(jobs), batch)
    )
    return padded / useful


def compare(
    num_prompts: int, input_len: int, output_len: int, batch: int, seed: int, plot_prefix: str
) -> dict[str, object]:
    jobs = make_jobs("longtail", num_prompts, input_len, output_len, seed)
    results: dict[str, object] = {}
    throughput = {}
    for mode in ("continuous", "static"):
        flags = ["--max-num-seqs", str(batch)] + (["--static-batching"] if mode == "static" else [])
        with launched_server(*flags) as server:
            # One client per batch slot, in job order: the static server then forms its
            # batches from consecutive jobs, as `ideal_ratio` assumes.
            outcomes: list[Outcome]
            outcomes, duration = asyncio.run(
                run_load(server.url, "SmolLM2-135M-Instruct", jobs, float("inf"), None, seed)
            )
        summary = summarize(outcomes, duration, slo_ttft=10.0, slo_tpot=1.0)
        throughput[mode] = summary["output_throughput"]
        results[mode] = summary
        if plot_prefix:
            plot(outcomes, f"{plot_prefix}-{mode}.png", f"{mode} batching, longtail")
    measured = throughput["continuous"] / throughput["static"]  # type: ignore[operator]
    ideal = ideal_ratio(jobs, batch)
    results["ratio"] = {"measured": measured, "ideal": ideal, "fraction_of_ideal": measured / ideal}
    return results
