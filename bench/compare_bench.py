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

import math
import statistics
import time

from turnstile.bench.serve_bench import Job, Outcome, make_jobs, plot, run_load, summarize
from turnstile.bench.server_process import Server, launched_server
from turnstile.scheduler_svc.service import STATUS_INTERVAL
from turnstile.shared.model_info import embedded_model_path, served_name


def _batches(jobs: list[Job], batch: int) -> list[list[Job]]:
    return [jobs[i : i + batch] for i in range(0, len(jobs), batch)]


def static_schedule_steps(jobs: list[Job], batch: int) -> int:
    """Steps of the static schedule the ideal ratio prices: each batch of consecutive jobs
    lasts as long as its longest request (its prefill step samples the first token)."""
    return sum(max(job.output_len for job in group) for group in _batches(jobs, batch))


def fewest_steps(jobs: list[Job], batch: int) -> int:
    """The fewest steps any schedule with `batch` slots serves the jobs in: every step full, and
    no fewer than the longest request. Continuous batching's excess over it is the run's end,
    where the batch drains with nothing left to admit."""
    outputs = [job.output_len for job in jobs]
    return max(-(-sum(outputs) // batch), max(outputs))


def ideal_ratio(jobs: list[Job], batch: int, with_prompts: bool = False) -> float:
    """Padded over useful tokens of the static schedule. With prompts: their tokens counted
    on both sides too (padded to the batch's longest, as HF `generate` pads them), for a device
    where a prompt token costs about what a decoded one does, as on this CPU; the issue's
    ideal counts generated tokens only."""

    def tokens(job: Job) -> int:
        return job.output_len + (len(job.prompt) if with_prompts else 0)

    useful = sum(tokens(job) for job in jobs)
    padded = 0
    for group in _batches(jobs, batch):
        longest_prompt = max(len(job.prompt) for job in group) if with_prompts else 0
        padded += len(group) * (max(job.output_len for job in group) + longest_prompt)
    return padded / useful


MODES = ("continuous", "padded", "compact")
# Evenly spaced in job order, so each static batch is consecutive jobs, as `ideal_ratio` assumes
# (sent all at once, the network reorders them: docs/benchmarks.md, "Behind the code's reasons").
ARRIVAL_RATE = 100.0
_STEPS = "turnstile:executor_step_seconds_count"
_STEP_SECONDS = "turnstile:executor_step_seconds_sum"
_TOKENS = "turnstile:generation_tokens_total"


def step_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the server's own counters say about a run: how many steps it took, how many
    useful tokens a step produced on average and how long a step took. Padding rows of
    static batching are computed but not counted as tokens."""
    steps = after[_STEPS] - before[_STEPS]
    return {
        "steps": steps,
        "useful_tokens_per_step": (after[_TOKENS] - before[_TOKENS]) / steps,
        "mean_step_ms": (after[_STEP_SECONDS] - before[_STEP_SECONDS]) / steps * 1000,
    }


def _serve(
    server: Server, model: str, jobs: list[Job], seed: int
) -> tuple[dict[str, object], list[Outcome]]:
    before = server.scrape()
    outcomes: list[Outcome]
    outcomes, duration = run_load(
        server.url, model, jobs, ARRIVAL_RATE, None, seed, burstiness=math.inf
    )
    summary = summarize(outcomes, duration, slo_ttft=10.0, slo_tpot=1.0)
    time.sleep(2.5 * STATUS_INTERVAL)  # the scheduler refreshes its token counters this often
    summary.update(step_stats(before, server.scrape()))
    return summary, outcomes


def compare(
    num_prompts: int, input_len: int, output_len: int, batch: int, seed: int, plot_prefix: str,
    rounds: int = 1,
) -> dict[str, object]:  # fmt: skip
    """Each round serves the jobs in every mode; the last round's summaries and plots, every
    round's throughputs and ratios, and their medians."""
    jobs = make_jobs("longtail", num_prompts, input_len, output_len, seed)
    model = served_name(embedded_model_path())
    ideal = ideal_ratio(jobs, batch)
    results: dict[str, object] = {}
    per_round: list[dict[str, float]] = []
    for round_ in range(rounds):
        measured: dict[str, float] = {}
        for mode in MODES:
            flags = ["--max-num-seqs", str(batch)]
            if mode != "continuous":
                flags += ["--static-batching", mode]
            with launched_server(*flags) as server:
                summary, outcomes = _serve(server, model, jobs, seed)
            results[mode] = summary
            measured[f"{mode}_tok_s"] = summary["output_throughput"]  # type: ignore[assignment]
            for stat in ("useful_tokens_per_step", "mean_step_ms"):
                measured[f"{mode}_{stat}"] = summary[stat]  # type: ignore[assignment]
            if plot_prefix and round_ == rounds - 1:
                plot(outcomes, f"{plot_prefix}-{mode}.png", f"{mode} batching, longtail")
        for static in MODES[1:]:
            ratio = measured["continuous_tok_s"] / measured[f"{static}_tok_s"]
            measured[f"over_{static}"] = ratio
            measured[f"over_{static}_fraction_of_ideal"] = ratio / ideal
        per_round.append(measured)
    results["ideal_ratio"] = ideal
    results["ideal_ratio_with_prompts"] = ideal_ratio(jobs, batch, with_prompts=True)
    results["ideal_schedule_steps"] = static_schedule_steps(jobs, batch)
    results["fewest_steps"] = fewest_steps(jobs, batch)
    results["rounds"] = per_round
    results["median"] = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
    return results
