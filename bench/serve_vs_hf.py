"""`turnstile bench serve-vs-hf`: our server under load next to Hugging Face `generate` on the
same prompts, in one run, repeated.

Each round launches `turnstile serve`, sends every request of the `random` dataset at once
(unbounded rate, streaming, EOS ignored), stops the server, then runs the same prompts through
HF's static `generate` in batches of --hf-batch, each in its fastest dtype here (the server's
`auto`; HF's bf16 only where torch multiplies bf16 in hardware, else float32). The two never
share the CPU. Medians over rounds, and the per-round ratio, are reported.
"""

from __future__ import annotations

import statistics

import torch

from turnstile.bench import hf_baseline
from turnstile.bench.serve_bench import make_jobs, run_load, summarize
from turnstile.bench.server_process import launched_server
from turnstile.executor_svc.cpu_runtime import best_dtype
from turnstile.shared.model_info import embedded_model_path, served_name


def compare(
    rounds: int, num_prompts: int, input_len: int, output_len: int, hf_batch: int, seed: int
) -> dict[str, object]:
    jobs = make_jobs("random", num_prompts, input_len, output_len, seed)
    prompts = [job.prompt for job in jobs]
    output_lens = [job.output_len for job in jobs]
    served = served_name(embedded_model_path())
    dtype = best_dtype(torch.device("cpu"))
    hf_dtype = hf_baseline.best_dtype()
    per_round = []
    for _ in range(rounds):
        with launched_server("--dtype", dtype) as server:
            outcomes, duration = run_load(server.url, served, jobs, float("inf"), None, seed)
        ours = summarize(outcomes, duration, slo_ttft=10.0, slo_tpot=1.0)
        model = hf_baseline.load_model(embedded_model_path(), hf_dtype)
        hf = hf_baseline.generate(model, prompts, output_lens, hf_batch)
        del model
        per_round.append(
            {
                "turnstile_output_tok_s": ours["output_throughput"],
                "turnstile_tpot_p50_ms": ours["tpot_ms"]["p50"],  # type: ignore[index]
                "turnstile_ttft_p50_s": ours["ttft_ms"]["p50"] / 1000,  # type: ignore[index]
                "turnstile_failed": ours["failed"],
                "hf_output_tok_s": hf.output_tok_s,
                "hf_tpot_p50_ms": hf.median_tpot_ms,
                "hf_ttft_p50_s": hf.median_ttft_s,
            }
        )
        per_round[-1]["throughput_ratio"] = (
            per_round[-1]["turnstile_output_tok_s"] / per_round[-1]["hf_output_tok_s"]
        )
    medians = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
    return {
        "setup": {
            "dtype": dtype, "hf_dtype": str(hf_dtype).removeprefix("torch."),
            "prompts": num_prompts, "input_len": input_len, "output_len": output_len,
            "hf_batch": hf_batch, "rounds": rounds,
        },
        "rounds": per_round,
        "median": medians,
    }  # fmt: skip
