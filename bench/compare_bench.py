"""`turnstile bench compare`: continuous against static batching in our own engine, on the
same long-tailed requests in one run, next to the ideal ratio.

Static batching admits a batch of --max-num-seqs requests only when the previous batch has
finished, so each batch costs as many steps as its longest request. Padded static batching (as
Hugging Face `generate` does it) also computes every finished row until then: padded / useful
tokens, the ideal ratio, is what continuous batching saves against it. Compact static batching
lets finished rows leave; on a CPU, where a step's cost grows with its batch, that is the
stronger baseline, and both are reported.
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
    for mode in ("continuous", "padded", "compact"):
        flags = ["--max-num-seqs", str(batch)]
        if mode != "continuous":
            flags += ["--static-batching", mode]
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
    ideal = ideal_ratio(jobs, batch)
    ratios: dict[str, float] = {"ideal": ideal}
    for static in ("padded", "compact"):
        ratios[f"over_{static}"] = throughput["continuous"] / throughput[static]  # type: ignore[operator]
        ratios[f"over_{static}_fraction_of_ideal"] = ratios[f"over_{static}"] / ideal
    results["ratio"] = ratios
    return results
