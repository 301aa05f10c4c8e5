"""Greedy parity with Hugging Face transformers, token for token, on the embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest
from msgspec.structs import replace

from turnstile.bench import parity_bench
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import OfflineEngine
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.model_info import embedded_model_path
from turnstile.shared.protocol import AddRequest, SamplingParams, pack_ids
from turnstile.shared.settings import build

pytestmark = pytest.mark.slow  # starts a stack or loads models

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


SCALINGS = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "linear": dict(rope_type="linear", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64),
}  # fmt: skip


@pytest.mark.parametrize("family", ["qwen2", "llama3", "linear", "yarn"])
def test_other_llama_family_checkpoints_match_hf(family: str, tmp_path: Path) -> None:
    """Small random checkpoints saved by transformers itself: Qwen2 (qkv bias, untied head)
    and Llama with each RoPE scaling (llama3, linear, yarn with its attention factor; the
    prompts run past yarn's original 64 positions; untied head). Greedy tokens equal HF's,
    prompt by prompt, with the prompts run together."""
    import torch
    import transformers

    torch.manual_seed(0)
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 tie_word_embeddings=False, initializer_range=0.2)  # fmt: skip
    if family == "qwen2":
        config = transformers.Qwen2Config(**shape, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(config)
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        with torch.no_grad():  # random init leaves biases at zero: make them count
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    else:
        config = transformers.LlamaConfig(**shape, rope_theta=5e5, rope_scaling=SCALINGS[family])
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    model.eval()
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(length)]
               for i, length in enumerate((3, 40, 17, 90))]  # fmt: skip
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)  # fmt: skip
            expected.append(out[0, len(ids) :].tolist())
    assert len({tuple(tokens) for tokens in expected}) == len(prompts)  # not degenerate
    engine = OfflineEngine(
        build(RunnerConfig, model=str(tmp_path), dtype="float32", num_blocks=64, max_num_seqs=4),
        SchedulingConfig(max_num_batched_tokens=32),
    )
    results = engine.generate(requests(prompts, SamplingParams()))
    assert [r.token_ids for r in results] == expected
    if family == "llama3":  # several EOS ids, as Llama 3.x has: generate stops at any of them
        eos = [config.eos_token_id, expected[0][5], expected[2][9]]
        transformers.GenerationConfig(eos_token_id=eos).save_pretrained(tmp_path)
        with torch.inference_mode():
            stopped = [
                model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=eos, pad_token_id=0)[0, len(ids):].tolist()
                for ids in prompts
            ]  # fmt: skip
        engine = OfflineEngine(build(RunnerConfig, model=str(tmp_path), dtype="float32"))
        ending = [replace(r, ignore_eos=False) for r in requests(prompts, SamplingParams())]
        ends = engine.generate(ending)
        assert [r.token_ids for r in ends] == stopped
        assert ends[0].finish_reason == ends[2].finish_reason == "stop"
