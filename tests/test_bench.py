from __future__ import annotations

import pytest

from turnstile.bench.compare_bench import fewest_steps, ideal_ratio
from turnstile.bench.serve_bench import Job, Outcome, arrival_gap, make_jobs, summarize
from turnstile.kernels import cpu_native


def test_datasets_are_seeded_and_shaped_as_documented() -> None:
    assert make_jobs("longtail", 50, 16, 64, seed=1) == make_jobs("longtail", 50, 16, 64, seed=1)
    longtail = make_jobs("longtail", 500, 16, 64, seed=1)
    outputs = [job.output_len for job in longtail]
    assert min(outputs) >= 8 and max(outputs) <= 1024 and max(outputs) > 4 * 64
    shared = make_jobs("shared-prefix", 8, 10, 5, seed=2, num_prefixes=2, prefix_len=30)
    assert shared[0].prompt[:30] == shared[2].prompt[:30] != shared[1].prompt[:30]
    assert all(len(job.prompt) == 40 for job in shared)
    ranged = make_jobs("random", 200, 100, 50, seed=3, range_ratio=0.5)
    assert {len(j.prompt) for j in ranged} <= set(range(50, 151)) and len(
        {j.output_len for j in ranged}
    ) > 10


def test_arrival_gaps_keep_the_rate_and_spread_with_burstiness() -> None:
    import math

    import numpy as np

    def gaps(burstiness: float) -> np.ndarray:
        rng = np.random.default_rng(0)
        return np.array([arrival_gap(rng, 4.0, burstiness) for _ in range(20000)])

    assert set(gaps(math.inf)) == {0.25}
    poisson, bursty, smooth = gaps(1.0), gaps(0.25), gaps(8.0)
    for sample in (poisson, bursty, smooth):
        assert abs(sample.mean() - 0.25) < 0.02
    # Coefficient of variation 1 / sqrt(shape): 1 for Poisson, 2 bursty, 0.35 smooth.
    assert smooth.std() < 0.5 * poisson.std() < 0.5 * bursty.std()


def test_ideal_ratio_is_padded_over_useful_tokens() -> None:
    jobs = [Job([1], n) for n in (1, 1, 1, 5)]
    assert ideal_ratio(jobs, 2) == (2 * 1 + 2 * 5) / 8
    assert ideal_ratio(jobs, 1) == 1.0
    prompted = [Job([1] * p, n) for p, n in ((1, 1), (3, 1), (1, 1), (1, 5))]
    assert ideal_ratio(prompted, 2, with_prompts=True) == (2 * (1 + 3) + 2 * (5 + 1)) / (8 + 6)


def test_fewest_steps_fills_every_slot_or_waits_for_the_longest() -> None:
    assert fewest_steps([Job([1], n) for n in (1, 1, 1, 5)], 2) == 5  # the longest
    assert fewest_steps([Job([1], n) for n in (3, 3, 3, 4)], 2) == 7  # 13 tokens, 2 a step
    assert fewest_steps([Job([1], n) for n in (3, 3, 3, 4)], 4) == 4


def test_summary_percentiles_and_goodput() -> None:
    outcomes = [
        Outcome(ok=True, output_tokens=11, ttft=0.1 * i, e2e=0.1 * i + 1.0, itl=[0.1] * 10)
        for i in range(1, 11)
    ] + [Outcome(ok=False, error="HTTP 503")]
    summary = summarize(outcomes, duration=10.0, slo_ttft=0.5, slo_tpot=0.2)
    assert (summary["completed"], summary["failed"]) == (10, 1)
    assert summary["output_throughput"] == 11.0
    assert summary["goodput"] == 0.5  # five requests met the 0.5 s TTFT objective
    assert round(summary["tpot_ms"]["p50"], 6) == 100.0
    assert summary["errors"] == ["HTTP 503"]


@pytest.mark.slow
def test_serve_vs_hf_puts_both_on_the_same_prompts_in_one_run() -> None:
    """A tiny round: our server and HF generate answer the same requests in full, and the
    report's ratio is their throughputs' ratio."""
    from turnstile.bench.serve_vs_hf import compare

    report = compare(rounds=1, num_prompts=4, input_len=8, output_len=6, hf_batch=2, seed=1)
    (round_,) = report["rounds"]  # type: ignore[misc]
    assert round_["turnstile_failed"] == 0
    assert round_["turnstile_output_tok_s"] > 0 and round_["hf_output_tok_s"] > 0
    assert round_["hf_tpot_p50_ms"] > 0 and round_["turnstile_tpot_p50_ms"] > 0
    ratio = round_["turnstile_output_tok_s"] / round_["hf_output_tok_s"]
    assert abs(round_["throughput_ratio"] - ratio) < 1e-9
    assert report["median"] == round_


@pytest.mark.slow
def test_compare_counts_steps_from_the_servers_own_counters() -> None:
    """A tiny compare: each mode's step count times its useful tokens per step is the tokens
    the client received, and padded static batching spends at least its batches' longest
    requests in steps (exactly the ideal's schedule, since requests arrive in job order), more
    than continuous batching needs."""
    from turnstile.bench.compare_bench import MODES, compare

    # Seed 3's lengths (46, 8, 9, 8, 8, 8): padded batching's 63 steps against continuous
    # batching's 48-50 here; seed 1's margin (37 against 36) was closed once in a loaded CI run.
    jobs = make_jobs("longtail", 6, 8, 6, seed=3)
    results = compare(
        num_prompts=6, input_len=8, output_len=6, batch=2, seed=3, plot_prefix="", rounds=1
    )
    for mode in MODES:
        summary = results[mode]
        assert summary["failed"] == 0  # type: ignore[index]
        received = summary["steps"] * summary["useful_tokens_per_step"]  # type: ignore[index]
        assert round(received) == summary["output_tokens"]  # type: ignore[index]
    longest_per_batch = sum(max(j.output_len for j in jobs[i : i + 2]) for i in range(0, 6, 2))
    assert results["ideal_schedule_steps"] == longest_per_batch
    for static in MODES[1:]:
        assert results[static]["steps"] == longest_per_batch  # type: ignore[index]
    assert results["continuous"]["steps"] < results["padded"]["steps"]  # type: ignore[index]
    assert results["continuous"]["steps"] >= results["fewest_steps"]  # type: ignore[index]


@pytest.mark.skipif(cpu_native.library() is None, reason="no native CPU kernels")
def test_the_sampler_bench_times_each_draw_on_the_same_probabilities() -> None:
    from turnstile.bench.sampler_bench import measure

    times = measure(rows=4, vocab=1000, repeats=2)
    assert list(times) == ["softmax", "torch hashed race", "native race"]
    assert all(ms > 0 for ms in times.values())
