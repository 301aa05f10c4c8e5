"""Greedy parity with Hugging Face transformers, token for token, on the embedded model."""

from __future__ import annotations

import pytest

from bench import parity_bench
from executor_svc.model_runner import RunnerConfig
from shared.model_info import embedded_model_path
from shared.protocol import AddRequest, SamplingParams, pack_ids
from turnstile.offline import OfflineEngine

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    return parity_bench.prompt_ids()


@pytest.fixture(scope="module")
def hf_greedy(prompt_ids: list[list[int]]) -> list[list[int]]:
    return parity_bench.hf_greedy(prompt_ids, NEW_TOKENS)


def requests(prompt_ids: list[list[int]], sampling: SamplingParams) -> list[AddRequest]:
    return [
        AddRequest(
            req_id=i,
            prompt_ids=pack_ids(ids),
            max_tokens=NEW_TOKENS,
            sampling=sampling,
            ignore_eos=True,
        )
        for i, ids in enumerate(prompt_ids)
    ]


def test_fp32_greedy_batch_with_chunking_and_preemption_equals_hf_alone(
    prompt_ids: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    longest = max(len(ids) for ids in prompt_ids)
    assert len(set(map(len, prompt_ids))) == len(prompt_ids) >= 8
    total = sum(len(ids) + NEW_TOKENS for ids in prompt_ids)
    num_blocks = total // 16 // 2  # half of what all requests need at once: forces preemption
    engine = OfflineEngine(
        RunnerConfig(
            embedded_model_path(), dtype="float32", num_blocks=num_blocks, max_num_seqs=16
        ),
        max_num_batched_tokens=longest // 2,
    )
    results = engine.generate(requests(prompt_ids, SamplingParams()))
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.scheduler.pool.num_free == num_blocks
    for i, result in enumerate(results):
        assert result.finish_reason == "length"
        assert result.token_ids == hf_greedy[i], f"prompt {i} diverged"


def test_same_seed_same_tokens_alone_or_batched(prompt_ids: list[list[int]]) -> None:
    engine = OfflineEngine(
        RunnerConfig(embedded_model_path(), dtype="float32", num_blocks=256, max_num_seqs=16)
    )
    sampling = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234)
    batched = engine.generate(requests(prompt_ids, sampling))
    alone = engine.generate(requests(prompt_ids[:1], sampling))
    assert alone[0].token_ids == batched[0].token_ids
    other_seed = engine.generate(requests(prompt_ids[:1], SamplingParams(temperature=0.8, seed=7)))
    assert other_seed[0].token_ids != alone[0].token_ids
