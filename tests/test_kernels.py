"""Triton kernels against the torch reference (under TRITON_INTERPRET=1, set in conftest), and
compiled ahead of time for Hopper and Ampere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from turnstile.executor_svc.plan_applier import StepInputs
from turnstile.executor_svc.step_layout import StepLayout
from turnstile.kernels import reference
from turnstile.kernels import triton_attention as triton_kernels
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.settings import build

HEADS, KV_HEADS, DIM = 9, 3, 64
# bf16: 2e-2, and torch's own relative tolerance for bf16 (1.6e-2: two bits of its 8), as the
# outputs reach 4 where a bit is 0.03.
TOLERANCE = {torch.float32: (1e-5, 0.0), torch.bfloat16: (2e-2, 1.6e-2)}


def assert_close_in(dtype: torch.dtype, got: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


def paged_setup(
    seq_lens: list[int], block_size: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random cache and block tables: each row owns distinct, shuffled blocks."""
    generator = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(widths) + 5
    shape = (num_blocks, block_size, KV_HEADS, DIM)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(seq_lens), max(widths), dtype=torch.int64)
    used = 0
    for row, width in enumerate(widths):
        tables[row, :width] = order[used : used + width]
        used += width
    return k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int64)


def pairwise(window: int) -> list[Any]:
    """(dtype, block size, window, soft cap): every pair of two of them's values, in 6 cases of
    the 12 (the interpreter takes 1-2 s a case)."""
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [(f32, 16, 0, 0.0), (bf16, 32, 0, 0.0), (f32, 32, window, 0.0),
             (bf16, 16, window, 0.0), (f32, 16, window, 0.5), (bf16, 32, window, 0.5)]  # fmt: skip
    return [
        pytest.param(*case, id="-".join(map(str, case)).replace("torch.", "")) for case in cases
    ]


# 20: windows that start mid-block; soft cap 0.5 (Gemma 2's is 50, on scores 100x these)
@pytest.mark.parametrize(("dtype", "block_size", "window", "softcap"), pairwise(20))
def test_paged_decode_matches_reference(
    dtype: torch.dtype, block_size: int, window: int, softcap: float
) -> None:
    seq_lens = [1, 15, 16, 17, 40, 97]
    k_cache, v_cache, tables, lens = paged_setup(seq_lens, block_size, dtype)
    query = torch.randn(len(seq_lens), HEADS, DIM).to(dtype)
    plan = reference.plan_decode(tables, lens, block_size)
    expected, got = (
        kernels.paged_decode_attention(query, k_cache, v_cache, plan, DIM**-0.5, window, softcap)
        for kernels in (reference, triton_kernels)
    )
    assert_close_in(dtype, got, expected)


# 11: some rows of a query tile see no early block
@pytest.mark.parametrize(("dtype", "block_size", "window", "softcap"), pairwise(11))
def test_chunked_prefill_over_cached_prefix_matches_reference(
    dtype: torch.dtype, block_size: int, window: int, softcap: float
) -> None:
    # (cached or earlier-computed tokens, new tokens this step) per row; ragged, some with
    # no prefix, some whose chunk starts mid-block, one longer than a query tile.
    rows = [(0, 5), (32, 17), (7, 40), (48, 16), (3, 2)]
    seq_lens = [cached + new for cached, new in rows]
    k_cache, v_cache, tables, lens = paged_setup(seq_lens, block_size, dtype, seed=1)
    query_start = torch.tensor([0] + [new for _, new in rows]).cumsum(0)
    query = torch.randn(int(query_start[-1]), HEADS, DIM).to(dtype)
    plan = reference.PrefillPlan(tables, lens, query_start, longest=40)
    args = (query, k_cache, v_cache, plan, DIM**-0.5, window, softcap)
    expected = reference.paged_prefill_attention(*args)
    got = triton_kernels.paged_prefill_attention(*args)
    assert_close_in(dtype, got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 11])
def test_attention_sinks_in_decode_and_prefill_match_reference(
    dtype: torch.dtype, window: int
) -> None:
    """gpt-oss's sinks: a logit a head in each softmax's sum, large enough to take a good share
    of it (the outputs move by far more than the tolerance without them)."""
    rows = [(0, 5), (32, 17), (7, 40), (3, 1)]
    seq_lens = [cached + new for cached, new in rows]
    k_cache, v_cache, tables, lens = paged_setup(seq_lens, 16, dtype, seed=2)
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(3)) + 1.0
    start = torch.tensor([0] + [new for _, new in rows]).cumsum(0)
    query = torch.randn(int(start[-1]), HEADS, DIM).to(dtype)
    prefill = (query, k_cache, v_cache, reference.PrefillPlan(tables, lens, start, 40),
               DIM**-0.5, window, 0.0, sinks)  # fmt: skip
    decode = (query[start[1:] - 1], k_cache, v_cache, reference.plan_decode(tables, lens, 16),
              DIM**-0.5, window, 0.0, sinks)  # fmt: skip
    for args, name in ((prefill, "paged_prefill_attention"), (decode, "paged_decode_attention")):
        expected = getattr(reference, name)(*args)
        got = getattr(triton_kernels, name)(*args)
        assert_close_in(dtype, got, expected)
        unsunk = getattr(reference, name)(*args[:-1])
        assert (unsunk.float() - expected.float()).abs().max() > 0.05


def test_prompts_from_position_zero_take_sdpas_causal_mask_and_match_the_mask_tensor() -> None:
    """A step whose prompt chunks all start at position 0 lets SDPA apply its own causal mask
    (top-left): rows padded to the longest must still see only their own keys."""
    seq_lens = [5, 17, 40]
    k_cache, v_cache, tables, lens = paged_setup(seq_lens, 16, torch.float32, seed=4)
    start = torch.tensor([0, *seq_lens]).cumsum(0)
    query = torch.randn(int(start[-1]), HEADS, DIM)
    masked, causal = (
        reference.paged_prefill_attention(
            query, k_cache, v_cache, reference.PrefillPlan(tables, lens, start, 40, fresh), 0.125
        )
        for fresh in (False, True)
    )
    torch.testing.assert_close(causal, masked, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("positions", "query_start", "from_start"),
    [
        ([0, 1, 2, 9], [0, 3, 4], True),  # a prompt from 0, a decode row
        ([0, 1, 2, 5, 6], [0, 3, 5], False),  # a second chunk, after a prefix
        ([9, 4], [0, 1, 2], False),  # decode rows only
    ],
)
def test_a_step_knows_on_the_host_whether_its_prompts_start_at_zero(
    positions: list[int], query_start: list[int], from_start: bool
) -> None:
    rows = len(query_start) - 1
    inputs = StepInputs(
        rows=np.arange(rows),
        input_ids=np.zeros(len(positions), dtype=np.int64),
        positions=np.array(positions),
        slot_mapping=np.array(positions),
        query_start_loc=np.array(query_start),
        seq_lens=np.ones(rows, dtype=np.int64),
        block_tables=np.zeros((rows, 1), dtype=np.int64),
        logits_indices=np.array(query_start[1:]) - 1,
        sample_rows=np.arange(rows),
    )
    assert StepLayout(inputs).from_start is from_start


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_by_slot_mapping_matches_reference(dtype: torch.dtype) -> None:
    shape = (8, 16, KV_HEADS, DIM)
    qkv = torch.randn(10, (HEADS + 2 * KV_HEADS) * DIM).to(dtype)
    key = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(10, KV_HEADS, DIM)
    value = qkv[:, (HEADS + KV_HEADS) * DIM :].view(10, KV_HEADS, DIM)
    slots = torch.randperm(8 * 16)[:10]
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(4)]
    reference.write_kv(key, value, caches[0], caches[1], slots)
    triton_kernels.write_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0


def test_kv_write_skips_slot_minus_one_the_padding_rows_of_a_cuda_graph() -> None:
    shape = (4, 16, KV_HEADS, DIM)
    key, value = torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    triton_kernels.write_kv(key, value, k_cache, v_cache, torch.tensor([5, -1, 20]))
    flat = k_cache.view(-1, KV_HEADS, DIM)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[20], key[2])
    assert torch.count_nonzero(flat.abs().sum(dim=(1, 2))) == 2
    assert torch.equal(v_cache.view(-1, KV_HEADS, DIM)[20], value[2])


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (5, 0.0), (5, 0.7)])
def test_reference_equals_dense_causal_attention(window: int, softcap: float) -> None:
    """The reference itself, against attention on unpaged tensors; with a window, query q sees
    keys q - window + 1 to q, as transformers' sliding-window mask; with a soft cap, scores are
    capped as Gemma 2's eager attention caps them. Decode attention of the last token equals
    prefill's last row."""
    k_cache, v_cache, tables, lens = paged_setup([21], 16, torch.float32, seed=2)
    query = torch.randn(21, HEADS, DIM)
    start = torch.tensor([0, 21])
    plan = reference.PrefillPlan(tables, lens, start, longest=21)
    got = reference.paged_prefill_attention(query, k_cache, v_cache, plan, 0.125, window,
                                            softcap)  # fmt: skip
    keys = k_cache[tables[0]].reshape(-1, KV_HEADS, DIM)[:21].repeat_interleave(3, dim=1)
    values = v_cache[tables[0]].reshape(-1, KV_HEADS, DIM)[:21].repeat_interleave(3, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, keys) * 0.125
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    hidden = torch.ones(21, 21).triu(1).bool()
    if window:
        hidden |= torch.ones(21, 21).tril(-window).bool()
    scores = scores.masked_fill(hidden, float("-inf"))
    dense = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=0)
    decode_plan = reference.plan_decode(tables, lens, 16)
    last = reference.paged_decode_attention(query[-1:], k_cache, v_cache, decode_plan, 0.125,
                                            window, softcap)  # fmt: skip
    torch.testing.assert_close(last, dense[-1:], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_every_kernel_compiles_ahead_of_time_for_sm90_and_sm80() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "turnstile.kernels.compile_check", "90", "80"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    sizes = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(sizes) == {"90", "80"}
    for per_target in sizes.values():
        assert len(per_target) == 6 and all(size > 1000 for size in per_target.values())


@pytest.mark.slow
def test_model_on_triton_kernels_generates_what_the_torch_path_generates(tmp_path: Path) -> None:
    """The whole executor on the cuda backend (its Triton kernels interpreted here: a real GPU
    is the one thing this machine lacks) against the torch reference, prefill in chunks and
    decode, on a random two-layer Llama (the interpreter runs each program in Python)."""
    from turnstile.bench import random_llama
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.offline import OfflineEngine
    from turnstile.shared.protocol import AddRequest, pack_ids

    model = random_llama.write(
        tmp_path, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2,
    )  # fmt: skip
    prompts = [[50, 357, 28, 464, 31], list(range(100, 121))]
    outputs = []
    for backend in ("torch", "cuda"):
        engine = OfflineEngine(
            build(
                RunnerConfig, model=str(model), dtype="float32", num_blocks=16, max_num_seqs=2,
                backend=backend,
            ),
            SchedulingConfig(max_num_batched_tokens=16),
        )  # fmt: skip
        requests = [
            AddRequest(req_id=i, prompt_ids=pack_ids(p), max_tokens=8, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        outputs.append([result.token_ids for result in engine.generate(requests)])
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 8 for tokens in outputs[0])
