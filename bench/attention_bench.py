"""`turnstile bench attention`: one layer's paged attention on the CPU over a bfloat16 (or, with
`--kv-cache-dtype`, an fp8) cache with the embedded model's heads (9 query heads on 3 KV heads,
head_dim 64): in float32 rows
(`attention.c`) and, where the CPU has AMX-BF16, on tiles (`attention_tiles.c`). Prompts run
causally, a row a token; decode rows a token each. Random cache values (the time does not
depend on them); blocks of 16, each sequence's scattered over the cache. As in a step, each
layer reads its own cache: a pass goes over the model's depth in caches, so that a decode's
keys and values come from memory, not from a cache the last call left warm."""

from __future__ import annotations

from collections.abc import Callable

import torch

from turnstile.bench.timing import median_ms
from turnstile.executor_svc.cpu_runtime import keep_freed_memory
from turnstile.kernels import cpu_native, native_attention, reference
from turnstile.shared.model_info import embedded_model_path, read_model_info

BLOCK = 16
# name: (sequences, tokens each, a prompt's rows (True) or one decode row each)
CASES = {
    "one 2,048-token prompt": (1, 2048, True),
    "one 1,536-token prompt": (1, 1536, True),
    "four 512-token prompts": (4, 512, True),
    "sixteen 128-token prompts": (16, 128, True),
    "64 decode rows at 200 tokens": (64, 200, False),
    "16 decode rows at 1,600 tokens": (16, 1600, False),
    "1 decode row at 1,600 tokens": (1, 1600, False),
}


def _inputs(
    sequences: int,
    tokens: int,
    prompt: bool,
    generator: torch.Generator,
    cache_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, reference.DecodePlan]:
    info = read_model_info(embedded_model_path())
    blocks = -(-tokens // BLOCK)
    shape = (sequences * blocks, BLOCK, info.num_kv_heads, info.head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(cache_dtype) for _ in "kv")
    tables = torch.randperm(sequences * blocks, generator=generator).view(sequences, blocks)
    if prompt:
        lens = torch.arange(1, tokens + 1).repeat(sequences)
        tables = tables.repeat_interleave(tokens, dim=0)
    else:
        lens = torch.full((sequences,), tokens)
    query = torch.randn(len(lens), info.num_heads, info.head_dim, generator=generator)
    return query, k_cache, v_cache, reference.plan_decode(tables, lens, BLOCK)


def measure(
    repeats: int = 15, cache_dtype: torch.dtype = torch.bfloat16
) -> dict[str, dict[str, float]]:
    """Per case, per path ("rows", and "tiles" where the CPU has them): ms a layer (median).
    The executor's heap settings: without them each call's buffers page-fault afresh, and a
    case could take 75-86 ms where it takes 42-45 (docs/benchmarks.md)."""
    keep_freed_memory()
    depth = read_model_info(embedded_model_path()).num_layers
    generator = torch.Generator().manual_seed(0)
    report: dict[str, dict[str, float]] = {}
    for case, (sequences, tokens, prompt) in CASES.items():
        query, k_cache, v_cache, plan = _inputs(sequences, tokens, prompt, generator, cache_dtype)
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(depth)]
        tiles = native_attention.on_tiles(k_cache, cpu_native.amx_tiles())
        paths = {"rows": False, **({"tiles": True} if tiles else {})}
        report[case] = {path: median_ms(_step(query, caches, plan, tiles), repeats) / depth
                        for path, tiles in paths.items()}  # fmt: skip
    return report


def _step(
    query: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    plan: reference.DecodePlan,
    tiles: bool,
) -> Callable[[], object]:
    scale = query.shape[-1] ** -0.5
    return lambda: [
        native_attention.paged_decode_attention(query, k, v, plan, scale, tiles=tiles)
        for k, v in caches
    ]
