"""`turnstile bench attention --prefill`: one layer's attention for prompt chunks on the CPU,
with the embedded model's heads (9 query heads on 3 KV heads, head_dim 64): the torch
reference's batched prefill (SDPA from a prompt's start without window, soft cap or sinks;
masked matmuls over every padded key otherwise) against each token a row of attention.c,
in float32 rows and, where the CPU has AMX-BF16, on tiles. gpt-oss's sinks (and its sliding
layers' window of 128) where a case names them. Random cache values, blocks of 16."""

from __future__ import annotations

from functools import partial

import torch

from turnstile.bench.timing import median_ms
from turnstile.executor_svc.cpu_runtime import keep_freed_memory
from turnstile.kernels import cpu_native, native_attention, reference
from turnstile.kernels.reference import PrefillPlan
from turnstile.shared.model_info import embedded_model_path, read_model_info

BLOCK = 16
# name: (prompts, new tokens each, tokens before them, window, sinks)
CASES = {
    "32 prompts of 128, sinks": (32, 128, 0, 0, True),
    "32 prompts of 128, sinks, window 128": (32, 128, 0, 128, True),
    "4 prompts of 1,536, sinks": (4, 1536, 0, 0, True),
    "4 prompts of 1,536, sinks, window 128": (4, 1536, 0, 128, True),
    "32 prompts of 128": (32, 128, 0, 0, False),
    "4 prompts of 1,536": (4, 1536, 0, 0, False),
    "4 chunks of 512 after 512": (4, 512, 512, 0, False),
}


def _inputs(
    prompts: int, new: int, before: int, cache_dtype: torch.dtype, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PrefillPlan]:
    info = read_model_info(embedded_model_path())
    blocks = -(-(before + new) // BLOCK)
    shape = (prompts * blocks, BLOCK, info.num_kv_heads, info.head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(cache_dtype) for _ in "kv")
    tables = torch.randperm(prompts * blocks, generator=generator).view(prompts, blocks)
    lens, starts = torch.full((prompts,), before + new), torch.arange(prompts + 1) * new
    plan = PrefillPlan(tables, lens, starts, new, from_start=not before)
    query = torch.randn(prompts * new, info.num_heads, info.head_dim, generator=generator)
    return query, k_cache, v_cache, plan


def measure(repeats: int, cache_dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """Per case, ms a layer (median) by the reference, by rows, and by rows on the tiles where
    they take the cache."""
    keep_freed_memory()
    generator = torch.Generator().manual_seed(0)
    report: dict[str, dict[str, float]] = {}
    for case, (prompts, new, before, window, with_sinks) in CASES.items():
        query, k_cache, v_cache, plan = _inputs(prompts, new, before, cache_dtype, generator)
        sinks = torch.randn(query.shape[1], generator=generator) if with_sinks else None
        scale = query.shape[-1] ** -0.5
        args = (query, k_cache, v_cache, plan, scale, window, 0.0, sinks)
        # Rows whatever the backend would pick (only where they win: the docstring).
        paths = {"reference": partial(reference.paged_prefill_attention, *args),
                 "rows": partial(native_attention.prefill_rows, *args, tiles=False)}  # fmt: skip
        if native_attention.on_tiles(k_cache, cpu_native.amx_tiles()):
            paths["tiles"] = partial(native_attention.prefill_rows, *args, tiles=True)
        report[case] = {path: median_ms(run, repeats) for path, run in paths.items()}
    return report
