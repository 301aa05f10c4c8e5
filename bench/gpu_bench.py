"""`turnstile bench gpu`: checks and measures the CUDA backend on the GPU it finds, in one run.

1. fp32 greedy parity with HF transformers on the parity prompts (both on this GPU), and bf16
   agreement with the same fp32 reference;
2. offline output tok/s against HF `generate` (bf16, batched) on the same GPU and prompts;
3. decode step time against the memory roofline: the bytes of weights and KV one step must
   read over the device's bandwidth (measured by a device copy, and the nominal figure given),
   for the embedded model and for a larger Llama-shaped model with random weights written by
   this command (speed does not depend on the values; a 135M model is launch-bound);
4. a served run: `turnstile serve --device cuda`, loaded by `turnstile bench serve`'s client.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from turnstile.bench import hf_baseline, parity_bench
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import OfflineEngine
from turnstile.shared.model_info import ModelInfo, embedded_model_path, served_name
from turnstile.shared.protocol import AddRequest, pack_ids
from turnstile.shared.settings import build

DEVICE = "cuda:0"
# Llama 3.2 1B's shape (random weights): big enough that a step is bound by memory, not launches.
LARGE_LLAMA = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": True,
}  # fmt: skip


def require_gpu() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("turnstile bench gpu needs a CUDA GPU; torch finds none here")


def _requests(prompts: list[list[int]], new_tokens: int, first: int = 0) -> list[AddRequest]:
    return [
        AddRequest(req_id=first + i, prompt_ids=pack_ids(p), max_tokens=new_tokens,
                   ignore_eos=True)
        for i, p in enumerate(prompts)
    ]  # fmt: skip


def parity(new_tokens: int) -> dict[str, object]:
    report = parity_bench.agreement(new_tokens, DEVICE)
    return {
        dtype: {"identical_prompts": f"{same} of 9", "tokens_before_divergence": f"{run}/{total}"}
        for dtype, (same, run, total) in report.items()
    }


def _config(path: Path, max_num_seqs: int, device: str) -> RunnerConfig:
    return build(RunnerConfig, model=str(path), device=device, max_num_seqs=max_num_seqs)


def offline(
    prompts: int, prompt_len: int, new_tokens: int, hf_batch: int, device: str = DEVICE
) -> dict[str, float]:
    path = embedded_model_path()
    rng = np.random.default_rng(0)
    token_ids = [rng.integers(100, 40000, prompt_len).tolist() for _ in range(prompts)]
    engine = OfflineEngine(_config(path, prompts, device))
    engine.generate(_requests(token_ids[:2], 4, first=10**6))  # warm-up
    started = time.perf_counter()
    results = engine.generate(_requests(token_ids, new_tokens))
    ours = sum(len(r.token_ids) for r in results) / (time.perf_counter() - started)
    del engine
    model = hf_baseline.load_model(path, torch.bfloat16).to(device)
    hf_baseline.generate(model, token_ids[:2], [4, 4], 2)  # warm-up
    hf = hf_baseline.generate(model, token_ids, [new_tokens] * prompts, hf_batch)
    return {"turnstile_tok_s": ours, "hf_tok_s": hf.output_tok_s, "ratio": ours / hf.output_tok_s}


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), median of 5."""
    source = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=DEVICE)
    target = torch.empty_like(source)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return 2 * source.numel() / statistics.median(times[1:])


def step_bytes(info: ModelInfo, itemsize: int, seq_lens: list[int]) -> int:
    """What one decode step must read: every weight once (the embedding only by the rows, so
    not at all unless tied to the output), and each row's whole KV."""
    per_layer = info.hidden_size * (info.num_heads + 2 * info.num_kv_heads) * info.head_dim
    per_layer += info.num_heads * info.head_dim * info.hidden_size
    per_layer += 3 * info.hidden_size * info.intermediate_size
    weights = info.num_layers * per_layer + info.vocab_size * info.hidden_size
    kv_per_token = 2 * info.num_layers * info.num_kv_heads * info.head_dim
    return (weights + kv_per_token * sum(seq_lens)) * itemsize


def decode_roofline(
    path: Path,
    rows: list[int],
    context: int,
    steps: int,
    bandwidth: float,
    nominal: float,
    device: str = DEVICE,
) -> list[dict[str, float]]:
    """Median decode step time for each batch size, and the time its bytes take at the measured
    and at the nominal bandwidth."""
    engine = OfflineEngine(_config(path, max(rows), device))
    scheduler, runner = engine.scheduler, engine.runner
    rng = np.random.default_rng(1)
    report = []
    for count in rows:
        prompts = [rng.integers(100, 30000, context).tolist() for _ in range(count)]
        for request in _requests(prompts, steps + 2, first=len(report) * 10**4):
            scheduler.add_request(request)
        times = []
        while scheduler.has_work:
            plan = scheduler.schedule()
            decoding = not plan.new and len(plan.override_ids) == 0
            started = time.perf_counter()
            scheduler.update(runner.execute(plan))  # ends with the sampled ids' copy: a sync
            if decoding:
                times.append(time.perf_counter() - started)
        seq_lens = [context + steps // 2] * count
        step_s = statistics.median(times)
        moved = step_bytes(runner.info, runner.model.dtype.itemsize, seq_lens)
        report.append({
            "rows": count, "step_ms": step_s * 1e3, "roofline_ms": moved / bandwidth * 1e3,
            "of_measured_roofline": moved / bandwidth / step_s,
            "of_nominal_roofline": moved / nominal / step_s,
        })  # fmt: skip
    return report


def write_random_llama(
    folder: Path, shape: dict[str, object] = LARGE_LLAMA, device: str = DEVICE
) -> Path:
    """A Llama-shaped model with random bf16 weights, as transformers writes one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, torch_dtype="bfloat16")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def served(prompts: int, input_len: int, output_len: int) -> dict[str, object]:
    from turnstile.bench.serve_bench import make_jobs, run_load, summarize
    from turnstile.bench.server_process import launched_server

    jobs = make_jobs("random", prompts, input_len, output_len, seed=0)
    with launched_server("--device", "cuda", ready_timeout=600) as server:
        outcomes, duration = run_load(
            server.url, served_name(embedded_model_path()), jobs, float("inf"), None, 0
        )
    summary = summarize(outcomes, duration, slo_ttft=10.0, slo_tpot=1.0)
    keep = ("completed", "failed", "output_throughput", "ttft_ms", "tpot_ms")
    return {key: summary[key] for key in keep}


@dataclass(frozen=True, slots=True)
class Measured:
    """What every section may use: the device's bandwidth and the command's settings."""

    bandwidth: float  # bytes/s, by a device copy
    nominal: float  # bytes/s, as the maker gives it
    new_tokens: int  # parity's tokens per prompt
    steps: int  # decode steps timed per batch size


ROWS = [1, 16, 64, 256]


def _decode_embedded(m: Measured) -> object:
    return decode_roofline(embedded_model_path(), ROWS, 512, m.steps, m.bandwidth, m.nominal)


def _decode_large(m: Measured) -> object:
    with tempfile.TemporaryDirectory() as folder:
        large = write_random_llama(Path(folder))
        return decode_roofline(large, ROWS, 512, m.steps, m.bandwidth, m.nominal)


# Each section alone: a GPU's first run must not lose the others' figures to one failure.
SECTIONS: dict[str, Callable[[Measured], object]] = {
    "parity": lambda m: parity(m.new_tokens),
    "offline_256x128x128": lambda m: offline(256, 128, 128, hf_batch=64),
    "decode_embedded": _decode_embedded,
    "decode_llama_1b_random": _decode_large,
    "served_256x128x128": lambda m: served(256, 128, 128),
}


def run(
    sections: list[str] | None,
    nominal_tbs: float,
    new_tokens: int,
    steps: int,
    report_to: Callable[[dict[str, object]], None],
) -> dict[str, object]:
    """The report so far goes to `report_to` as each section ends; a section that raises gives
    its traceback's last lines in its place, and the next still runs. `sections`: None, all."""
    unknown = set(sections or ()) - SECTIONS.keys()
    if unknown:
        raise SystemExit(f"no section {', '.join(sorted(unknown))}: choose from {list(SECTIONS)}")
    require_gpu()
    measured = Measured(copy_bandwidth(), nominal_tbs * 1e12, new_tokens, steps)
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "copy_bandwidth_tbs": measured.bandwidth / 1e12,
        "nominal_bandwidth_tbs": nominal_tbs,
    }
    for name in sections or SECTIONS:
        started = time.perf_counter()
        try:
            report[name] = SECTIONS[name](measured)
        except Exception:  # reported, not raised: the other sections still run
            report[name] = {"error": traceback.format_exc().splitlines()[-12:]}
        report[f"{name}_seconds"] = round(time.perf_counter() - started, 1)
        gc.collect()
        torch.cuda.empty_cache()
        report_to(report)
    return report
