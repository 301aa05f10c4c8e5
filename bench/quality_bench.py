"""`turnstile bench quality`: what a weight format costs in quality, against the float32 path of
the same weights: greedy agreement on the parity prompts (prompts identical, tokens before the
first divergence) and perplexity on a fixed text (`data/quality_text.txt`, shipped)."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from turnstile.bench.parity_bench import greedy_requests, prompt_ids
from turnstile.bench.requantize import Q, everywhere, requantize
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import OfflineEngine
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.protocol import AddRequest, SamplingParams, pack_ids
from turnstile.shared.settings import build
from turnstile.shared.tokenizer import Tokenizer

TEXT = Path(__file__).parent / "data" / "quality_text.txt"
# Each path as `turnstile serve` flags: exact float32, bfloat16 weights (and, where AMX-BF16 tiles
# would take them, in float32 arithmetic on a float32 KV cache), the GGUF blocks kept (with their
# default bfloat16 KV cache, with a float32 one, with fp8 ones, with the bf16 cache's attention
# in float32 rows where AMX tiles would take it, and multiplied as blocks where AMX-INT8 tiles
# would take their values requantized).
PATHS = {
    "float32": dict(dtype="float32", quantization="none"),
    "bfloat16": dict(dtype="bfloat16", quantization="none"),
    "bfloat16, float32 rows": dict(dtype="bfloat16", quantization="none", cpu_bf16_products="rows"),
    "gguf": dict(quantization="gguf"),
    "gguf, float32 KV": dict(quantization="gguf", kv_cache_dtype="float32"),
    "gguf, fp8 (e4m3) KV": dict(quantization="gguf", kv_cache_dtype="fp8"),
    "gguf, fp8_e5m2 KV": dict(quantization="gguf", kv_cache_dtype="fp8_e5m2"),
    "gguf, float32 rows attention": dict(quantization="gguf", cpu_attention="rows"),
    "gguf, blocks products": dict(quantization="gguf", cpu_products="blocks"),
}


@dataclass(frozen=True, slots=True)
class Quality:
    perplexity: float
    identical: int  # prompts whose greedy tokens equal float32's
    same_prefix: int  # tokens before each prompt's first divergence from float32, summed
    tokens: int


def perplexity(engine: OfflineEngine, text_ids: list[int]) -> float:
    """exp of the mean negative logprob of each token of the text given those before it."""
    request = AddRequest(req_id=0, prompt_ids=pack_ids(text_ids), max_tokens=1,
                         sampling=SamplingParams(prompt_logprobs=0))  # fmt: skip
    logprobs = engine.generate([request])[0].prompt_logprobs
    assert len(logprobs) == len(text_ids) - 1
    return math.exp(-sum(logprobs) / len(logprobs))


def measure(
    new_tokens: int = 64, paths: tuple[str, ...] = tuple(PATHS), model: Path | None = None
) -> dict[str, Quality]:
    """Each path's quality on `model` (the embedded one by default); float32 is the reference."""
    model = model or embedded_model_path()
    tokenizer = Tokenizer(model, read_model_info(model))
    text_ids, prompts = tokenizer.encode(TEXT.read_text()), prompt_ids(tokenizer)
    report: dict[str, Quality] = {}
    reference: list[list[int]] = []
    for name in ("float32", *(p for p in paths if p != "float32")):
        engine = OfflineEngine(build(RunnerConfig, model=str(model), num_blocks=512, **PATHS[name]))
        tokens = [r.token_ids for r in engine.generate(greedy_requests(prompts, new_tokens))]
        reference = reference or tokens
        same = sum(
            next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), new_tokens)
            for ours, ref in zip(tokens, reference, strict=True)
        )
        identical = sum(ours == ref for ours, ref in zip(tokens, reference, strict=True))
        report[name] = Quality(perplexity(engine, text_ids), identical, same,
                               new_tokens * len(prompts))  # fmt: skip
    return report


def measure_formats(
    kinds: tuple[str, ...], folder: Path, new_tokens: int = 64
) -> dict[str, dict[str, Quality]]:
    """For each GGUF block type, the embedded model's layer matrices stored in it where their
    rows are whole blocks (K-quants: only the down projections, 1,536 inputs; the rest stays
    Q4_1), the default quantized path against the float32 path of that same file."""
    report = {}
    for kind in kinds:
        model = requantize(embedded_model_path(), folder / f"{kind}.gguf", everywhere(Q[kind]))
        report[kind] = measure(new_tokens, ("float32", "gguf"), model)
    return report


def report(new_tokens: int, kinds: tuple[str, ...]) -> list[str]:
    """`turnstile bench quality`'s lines: the embedded file's paths, then each of `kinds`."""
    reports = {"the embedded file": measure(new_tokens)}
    cache = os.environ.get("TURNSTILE_CACHE")
    with tempfile.TemporaryDirectory() as folder:
        os.environ["TURNSTILE_CACHE"] = folder  # the float32 copies of its files: 0.5 GB each
        try:
            for kind, quality in measure_formats(kinds, Path(folder), new_tokens).items():
                reports[f"layers in {kind}"] = quality
        finally:
            if cache is None:
                del os.environ["TURNSTILE_CACHE"]
            else:
                os.environ["TURNSTILE_CACHE"] = cache
    lines = []
    for model, paths in reports.items():
        reference = paths["float32"].perplexity
        lines += [
            f"{model}, {name}: perplexity {q.perplexity:.4f} "
            f"({q.perplexity / reference - 1:+.2%} vs float32); {q.identical} of 9 prompts "
            f"identical to float32, {q.same_prefix} of {q.tokens} tokens before the first "
            "divergence"
            for name, q in paths.items()
        ]
    return lines
