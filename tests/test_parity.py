"""Greedy parity with Hugging Face transformers, token for token, on the embedded model."""

from __future__ import annotations

import pytest
import torch

from executor_svc.model_runner import RunnerConfig
from shared.model_info import embedded_model_path, read_model_info
from shared.protocol import AddRequest, SamplingParams, pack_ids
from shared.tokenizer import Tokenizer
from turnstile.offline import OfflineEngine

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woman who knew the names of every tree and every bird, and the children",
    "def fibonacci(n):",
    "Q: What is the boiling point of water at sea level?\nA:",
    "List three primary colors, then explain how to mix them:",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Translate to French: I would like a cup of coffee, please.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "The quick brown fox jumps over the lazy dog. Write a short poem about a fox and a dog who "
    "become friends after a long winter, in the style of a nursery rhyme:",
    "Hi",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    path = embedded_model_path()
    tokenizer = Tokenizer(path, read_model_info(path))
    return [tokenizer.encode(prompt) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(prompt_ids: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    # Like ignore_eos: run past EOS (min_new_tokens would instead forbid EOS and change tokens).
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            generated = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=2,
            )
            outputs.append(generated[0, len(ids) :].tolist())
    return outputs


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
