"""`turnstile bench offline`: our engine against Hugging Face transformers' static `generate`,
same model, prompts, dtype and machine, in one run.

`--dtype auto` runs the server's defaults (on the CPU, a GGUF file's blocks kept quantized);
a dtype runs dequantized weights in it. HF runs in the dtype it is fastest in here.

Throughput: N random prompts of L tokens, M new tokens each (EOS ignored). Latency: one
request alone, the median decode step. The matmul ceiling is this machine's measured
matrix-multiply rate divided by the weight FLOPs each output token costs in this workload: its
own pass through every layer and the vocabulary projection, plus its share of the prompts'
passes (L / M prompt tokens per output token, vocabulary projection left out).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from turnstile.bench import hf_baseline
from turnstile.executor_svc.backends.packed_projection import PackedProjection
from turnstile.executor_svc.model.projection import DenseProjection
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.kernels import cpu_native
from turnstile.offline import OfflineEngine
from turnstile.shared.model_info import ModelInfo, embedded_model_path
from turnstile.shared.protocol import AddRequest, pack_ids
from turnstile.shared.settings import build


@dataclass(slots=True)
class OfflineRound:
    ours_tok_s: float
    hf_tok_s: float
    ours_ms_per_token_alone: float
    hf_ms_per_token_alone: float
    ceiling_tok_s: float  # this round's float32 matmul rate, over the workload's FLOPs


@dataclass(slots=True)
class OfflineReport:
    weights: str
    hf_dtype: str
    prompts: int
    prompt_len: int
    new_tokens: int
    hf_batch: int
    rounds: list[OfflineRound]

    def median(self, field: str) -> float:
        return statistics.median(getattr(r, field) for r in self.rounds)

    def lines(self) -> list[str]:
        ratios = [r.ours_tok_s / r.hf_tok_s for r in self.rounds]
        of_ceiling = [r.ours_tok_s / r.ceiling_tok_s for r in self.rounds]
        return [
            f"weights: turnstile {self.weights}, HF {self.hf_dtype}; "
            f"{self.prompts} prompts x {self.prompt_len} in / "
            f"{self.new_tokens} out; medians of {len(self.rounds)} rounds",
            f"turnstile: {self.median('ours_tok_s'):.1f} output tok/s "
            f"({statistics.median(of_ceiling):.0%} of the float32 matmul ceiling)",
            f"HF transformers generate, batch {self.hf_batch}: "
            f"{self.median('hf_tok_s'):.1f} output tok/s",
            f"ratio: {statistics.median(ratios):.2f}x "
            f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})",
            f"alone: turnstile {self.median('ours_ms_per_token_alone'):.1f} ms/token, "
            f"HF {self.median('hf_ms_per_token_alone'):.1f} ms/token",
            f"float32 matmul ceiling {self.median('ceiling_tok_s'):.0f} tok/s",
        ]


def _matmul_gflops(rows: int) -> float:
    """This machine's float32 matmul rate at the model's gate-up shape: the faster of torch's
    own and the projection Turnstile uses (the native kernel where it builds)."""
    x = torch.randn(rows, 576)
    weight = torch.randn(1536, 576)
    native = cpu_native.library() is not None
    projection = PackedProjection(weight, None) if native else DenseProjection(weight)
    rates = []
    for multiply in (lambda: torch.nn.functional.linear(x, weight), lambda: projection(x)):
        multiply()
        runs = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(20):
                multiply()
            runs.append((time.perf_counter() - started) / 20)
        rates.append(2 * rows * 576 * 1536 / statistics.median(runs) / 1e9)
    return max(rates)


def _requests(prompts: list[list[int]], new_tokens: int) -> list[AddRequest]:
    return [
        AddRequest(req_id=i, prompt_ids=pack_ids(p), max_tokens=new_tokens, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]


def run(
    prompts: int, prompt_len: int, new_tokens: int, hf_batch: int, dtype: str, rounds: int = 1
) -> OfflineReport:
    """Each round times our engine, then HF on the same prompts; the two never overlap."""
    path = embedded_model_path()
    rng = np.random.default_rng(0)

    def fresh(count: int) -> list[list[int]]:
        # Never a prompt seen before: ours would come from the prefix cache, HF's would not.
        return [rng.integers(100, 40000, prompt_len).tolist() for _ in range(count)]

    chosen = {} if dtype == "auto" else {"dtype": dtype}
    engine = OfflineEngine(build(RunnerConfig, model=str(path), max_num_seqs=prompts, **chosen))
    runner = engine.runner
    weights = "GGUF blocks kept" if runner.quantized else str(runner.dtype).removeprefix("torch.")
    engine.generate(_requests(fresh(2), 4))  # warm-up
    hf_dtype = hf_baseline.best_dtype()
    model = hf_baseline.load_model(path, hf_dtype)
    flops = _flops_per_output_token(engine.runner.info, prompt_len, new_tokens)
    measured = []
    for _ in range(rounds):
        token_ids = fresh(prompts)
        started = time.perf_counter()
        results = engine.generate(_requests(token_ids, new_tokens))
        ours = sum(len(r.token_ids) for r in results) / (time.perf_counter() - started)
        alone = _ms_per_token_alone(engine, token_ids[0], new_tokens)
        hf = hf_baseline.generate(model, token_ids, [new_tokens] * prompts, hf_batch)
        hf_alone = hf_baseline.generate(model, token_ids[:1], [new_tokens], 1)
        gflops = _matmul_gflops(prompts)
        measured.append(
            OfflineRound(
                ours_tok_s=ours,
                hf_tok_s=hf.output_tok_s,
                ours_ms_per_token_alone=alone,
                hf_ms_per_token_alone=hf_alone.median_tpot_ms,
                ceiling_tok_s=gflops * 1e9 / flops,
            )
        )
    hf_name = str(hf_dtype).removeprefix("torch.")
    return OfflineReport(weights, hf_name, prompts, prompt_len, new_tokens, hf_batch, measured)


def _flops_per_output_token(info: ModelInfo, prompt_len: int, new_tokens: int) -> float:
    layer_params = info.num_layers * (
        info.hidden_size * (info.num_heads + 2 * info.num_kv_heads) * info.head_dim
        + info.num_heads * info.head_dim * info.hidden_size
        + 3 * info.hidden_size * info.intermediate_size
    )
    params = layer_params + info.vocab_size * info.hidden_size
    return 2 * params + 2 * layer_params * prompt_len / new_tokens


def _ms_per_token_alone(engine: OfflineEngine, prompt: list[int], new_tokens: int) -> float:
    """Median decode step of one request alone (its prefill step left out)."""
    scheduler, runner = engine.scheduler, engine.runner
    scheduler.add_request(_requests([prompt], new_tokens)[0])
    steps = []
    while scheduler.has_work:
        started = time.perf_counter()
        scheduler.update(runner.execute(scheduler.schedule()))
        steps.append(time.perf_counter() - started)
    return statistics.median(steps[1:]) * 1000
