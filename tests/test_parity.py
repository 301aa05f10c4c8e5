"""Greedy parity with Hugging Face transformers, token for token, on the embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import fixed_length_requests

from turnstile.bench import parity_bench
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import OfflineEngine
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.model_info import embedded_model_path
from turnstile.shared.protocol import AddRequest, SamplingParams
from turnstile.shared.settings import build

pytestmark = pytest.mark.slow  # starts a stack or loads models

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    return parity_bench.prompt_ids()


@pytest.fixture(scope="module")
def hf_greedy(prompt_ids: list[list[int]]) -> list[list[int]]:
    return parity_bench.hf_greedy(prompt_ids, NEW_TOKENS, batched=True)


def requests(prompt_ids: list[list[int]], sampling: SamplingParams) -> list[AddRequest]:
    return fixed_length_requests(prompt_ids, sampling, NEW_TOKENS)


def test_fp32_greedy_batch_with_chunking_and_preemption_equals_hfs_batch(
    prompt_ids: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    longest = max(len(ids) for ids in prompt_ids)
    assert len(set(map(len, prompt_ids))) == len(prompt_ids) >= 8
    total = sum(len(ids) + NEW_TOKENS for ids in prompt_ids)
    num_blocks = total // 16 // 2  # half of what all requests need at once: forces preemption
    engine = OfflineEngine(
        build(RunnerConfig, dtype="float32", num_blocks=num_blocks, max_num_seqs=16),
        SchedulingConfig(max_num_batched_tokens=longest // 2),
    )
    results = engine.generate(requests(prompt_ids, SamplingParams()))
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.scheduler.pool.num_free == num_blocks
    for i, result in enumerate(results):
        assert result.finish_reason == "length"
        assert result.token_ids == hf_greedy[i], f"prompt {i} diverged"


def test_same_seed_same_tokens_alone_or_batched(prompt_ids: list[list[int]]) -> None:
    engine = OfflineEngine(build(RunnerConfig, dtype="float32", num_blocks=256, max_num_seqs=16))
    sampling = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234)
    batched = engine.generate(requests(prompt_ids, sampling))
    alone = engine.generate(requests(prompt_ids[:1], sampling))
    assert alone[0].token_ids == batched[0].token_ids
    other_seed = engine.generate(requests(prompt_ids[:1], SamplingParams(temperature=0.8, seed=7)))
    assert other_seed[0].token_ids != alone[0].token_ids


def test_a_hugging_face_safetensors_folder_serves_like_the_gguf(
    prompt_ids: list[list[int]], hf_greedy: list[list[int]], tmp_path: Path
) -> None:
    """Write the embedded model out as a Hugging Face folder (config.json, safetensors,
    tokenizer.json) and load it through the safetensors path: same greedy tokens."""
    import json

    from safetensors.torch import save_file

    from turnstile.executor_svc.model.weights import load_weights
    from turnstile.shared.model_info import read_model_info

    gguf = embedded_model_path()
    info = read_model_info(gguf)
    weights = load_weights(gguf, info)
    save_file({name: tensor.contiguous() for name, tensor in weights.items()},
              tmp_path / "model.safetensors")  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": info.num_layers,
        "hidden_size": info.hidden_size, "intermediate_size": info.intermediate_size,
        "num_attention_heads": info.num_heads, "num_key_value_heads": info.num_kv_heads,
        "vocab_size": info.vocab_size, "max_position_embeddings": info.max_model_len,
        "rope_theta": info.rope_theta, "rms_norm_eps": info.rms_norm_eps,
        "bos_token_id": info.bos_token_id, "eos_token_id": info.eos_token_id,
        "tie_word_embeddings": True,
    }))  # fmt: skip
    engine = OfflineEngine(
        build(RunnerConfig, model=str(tmp_path), dtype="float32", num_blocks=256, max_num_seqs=16)
    )
    assert engine.runner.info.num_kv_heads == 3 and engine.runner.info.tie_word_embeddings
    results = engine.generate(requests(prompt_ids[:3], SamplingParams()))
    assert [r.token_ids for r in results] == hf_greedy[:3]
