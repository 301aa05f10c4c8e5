"""Each model family Turnstile serves, proven against transformers: a small random checkpoint
saved by transformers' own classes, with the family's features switched on, generates the same
greedy tokens as `generate` (fp32, prompts run together, chunked, with a preemption), and every
step's top logprobs agree with transformers' logits to 1e-4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import fixed_length_requests
from msgspec.structs import replace

from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import OfflineEngine
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.protocol import AddRequest, SamplingParams
from turnstile.shared.settings import build

pytestmark = pytest.mark.slow  # loads transformers

NEW_TOKENS = 48
TOP = 5  # logprobs compared at every step: the chosen token's and the top 5
SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             tie_word_embeddings=False, initializer_range=0.2)  # fmt: skip
SCALINGS = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "linear": dict(rope_type="linear", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64),
    # from max_position_embeddings, 96 here (`_checkpoint`): the longest sequence grows past it
    "dynamic": dict(rope_type="dynamic", factor=2.0),
}  # fmt: skip
# Phi-3's: factors per frequency (head_dim 32), the long ones past 256 positions.
LONGROPE = dict(rope_type="longrope", original_max_position_embeddings=256,
                short_factor=[1.0 + 0.1 * i for i in range(16)],
                long_factor=[2.0 + 0.3 * i for i in range(16)])  # fmt: skip
# Prompts of 3 to 90 tokens: the longest runs past yarn's original 64 positions and every
# sliding window below.
PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((3, 40, 17, 90))]


def _randomize(parameters: Any) -> None:
    """Random init leaves biases at 0 and norms at 1: make them count."""
    for parameter in parameters:
        parameter.data.normal_(1.0 if parameter.dim() == 1 and parameter.data.eq(1).all() else 0.0,
                               0.5)  # fmt: skip


def _checkpoint(family: str, dense_layers: tuple[int, ...] = (1,)) -> Any:
    """A transformers model of `family` with its features on (Qwen3-MoE: a dense MLP on
    `dense_layers`)."""
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "qwen2":  # q, k and v biases; the second layer slides over 24 tokens
        config = transformers.Qwen2Config(**SHAPE, rope_theta=1e6, use_sliding_window=True,
                                          sliding_window=24, max_window_layers=1)  # fmt: skip
        assert config.layer_types == ["full_attention", "sliding_attention"]
        model = transformers.Qwen2ForCausalLM(config)
        _randomize(p for n, p in model.named_parameters() if n.endswith("bias"))
    elif family == "qwen3":  # q/k norm; the second layer slides over 24 tokens
        config = transformers.Qwen3Config(**SHAPE, head_dim=48, use_sliding_window=True,
                                          sliding_window=24, max_window_layers=1)  # fmt: skip
        assert config.layer_types == ["full_attention", "sliding_attention"]
        model = transformers.Qwen3ForCausalLM(config)
        norms = ("q_norm.weight", "k_norm.weight")
        _randomize(p for n, p in model.named_parameters() if n.endswith(norms))
    elif family == "mistral":  # every layer slides over 24 tokens
        config = transformers.MistralConfig(**SHAPE, sliding_window=24)
        model = transformers.MistralForCausalLM(config)
    elif family == "phi4mini":  # Phi-4-mini: RoPE (longrope) on the first 3/4 of each head
        scaling = {
            **LONGROPE,
            "short_factor": LONGROPE["short_factor"][:12],
            "long_factor": LONGROPE["long_factor"][:12],
            "partial_rotary_factor": 0.75,
        }
        config = transformers.Phi3Config(**SHAPE, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                         rope_scaling=scaling,
                                         original_max_position_embeddings=256)  # fmt: skip
        model = transformers.Phi3ForCausalLM(config)
    elif family == "phi3":  # fused qkv and gate_up; longrope (short factors here); a window
        config = transformers.Phi3Config(**SHAPE, pad_token_id=0, bos_token_id=1,
                                         eos_token_id=2, rope_scaling=LONGROPE,
                                         original_max_position_embeddings=256,
                                         sliding_window=40)  # fmt: skip
        assert config.rope_parameters["original_max_position_embeddings"] == 256
        model = transformers.Phi3ForCausalLM(config)
    elif family == "gemma3":  # Gemma 3's layer: every feature on, a sliding then a full layer
        config = transformers.Gemma3TextConfig(
            **{**SHAPE, "tie_word_embeddings": True}, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=24, layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=3.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                             "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 1e6}},
        )  # fmt: skip
        model = transformers.Gemma3ForCausalLM(config)
        _randomize(p for n, p in model.named_parameters() if n.endswith("norm.weight"))
    elif family == "gemma2":  # Gemma 2: scores soft-capped, sliding then full layers
        config = transformers.Gemma2Config(
            **{**SHAPE, "tie_word_embeddings": True}, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=24, attn_logit_softcapping=1.5, final_logit_softcapping=3.0,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        assert config.layer_types == ["sliding_attention", "full_attention"]
        model = transformers.Gemma2ForCausalLM(config)
        _randomize(p for n, p in model.named_parameters() if n.endswith("norm.weight"))
    elif family == "mixtral":  # 4 experts, 2 a token; every layer slides over 40 tokens
        config = transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2,
                                            sliding_window=40)  # fmt: skip
        model = transformers.MixtralForCausalLM(config)
    elif family == "qwen3_moe":  # experts of their own width on layer 0, a dense MLP on layer 1
        # (the GGUF test: experts on both); every layer slides over 24 tokens, whatever
        # max_window_layers says (transformers' Qwen3-MoE has no layer types)
        config = transformers.Qwen3MoeConfig(**SHAPE, num_experts=8, num_experts_per_tok=3,
                                             moe_intermediate_size=64, norm_topk_prob=False,
                                             mlp_only_layers=list(dense_layers),
                                             use_sliding_window=True, sliding_window=24,
                                             max_window_layers=1)  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(config)
        routers = ("gate.weight", "q_norm.weight", "k_norm.weight")  # a zero router ties
        _randomize(p for n, p in model.named_parameters() if n.endswith(routers))
    elif family == "granite":  # embeddings, scores, residual adds and logits scaled
        config = transformers.GraniteConfig(**SHAPE, embedding_multiplier=3.0,
                                            attention_multiplier=0.05, residual_multiplier=0.4,
                                            logits_scaling=1.5)  # fmt: skip
        model = transformers.GraniteForCausalLM(config)
    elif family == "olmo2":  # each block's output normed, not its input; q and k across heads
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**SHAPE, pad_token_id=0))
        _randomize(p for n, p in model.named_parameters() if n.endswith("norm.weight"))
    elif family == "smollm3":  # the second layer without RoPE
        config = transformers.SmolLM3Config(**SHAPE, no_rope_layers=[1, 0], pad_token_id=0)
        model = transformers.SmolLM3ForCausalLM(config)
    else:  # Llama with each RoPE scaling
        shape = {**SHAPE, "max_position_embeddings": 96} if family == "dynamic" else SHAPE
        config = transformers.LlamaConfig(**shape, rope_theta=5e5, rope_scaling=SCALINGS[family])
        model = transformers.LlamaForCausalLM(config)
    return model.eval()


def _hf_generate(model: Any) -> tuple[list[list[int]], list[Any]]:
    """Greedy tokens and each step's log-softmaxed logits, prompt by prompt."""
    import torch

    tokens, logprobs = [], []
    with torch.inference_mode():
        for ids in PROMPTS:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
            tokens.append(out.sequences[0, len(ids) :].tolist())
            logprobs.append(torch.cat(out.logits).float().log_softmax(-1))
    return tokens, logprobs


def _requests(logprobs: int | None = TOP) -> list[AddRequest]:
    return fixed_length_requests(PROMPTS, SamplingParams(logprobs=logprobs), NEW_TOKENS)


# cpu: its fused native layers take most steps; torch: the model's layers take every step.
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize(
    "family",
    ["qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "granite", "mixtral", "qwen3_moe",
     "olmo2", "smollm3", "phi4mini", "llama3", "linear", "yarn", "dynamic"],
)  # fmt: skip
def test_a_family_checkpoint_generates_what_transformers_generates(
    family: str, backend: str, tmp_path: Path
) -> None:
    model = _checkpoint(family)
    model.save_pretrained(tmp_path)
    generates_what_transformers_generates(tmp_path, model, family, backend)


def generates_what_transformers_generates(model_path: Path, model: Any, family: str,
                                          backend: str) -> None:  # fmt: skip
    """Turnstile, serving `model_path`, generates `model`'s tokens and logprobs."""
    import torch

    expected, hf_logprobs = _hf_generate(model)
    assert len({tuple(tokens) for tokens in expected}) == len(PROMPTS)  # not degenerate
    # 12 blocks of 16 for 4 sequences of up to 138 tokens: some are preempted and recomputed.
    # Where every layer slides over 24 tokens (Mistral, Qwen3-MoE) sequences hold at most 5
    # blocks (the window and a 32-token chunk): 6 blocks, fewer than the longest sequence
    # fills, which runs only because the blocks behind the window go back to the pool.
    narrow = family in ("mistral", "qwen3_moe")
    blocks = 6 if narrow else 12
    assert not narrow or len(PROMPTS[-1]) + NEW_TOKENS > blocks * 16
    config = build(RunnerConfig, model=str(model_path), dtype="float32", backend=backend,
                   num_blocks=blocks, max_num_seqs=4)  # fmt: skip
    engine = OfflineEngine(config, SchedulingConfig(max_num_batched_tokens=32))
    results = engine.generate(_requests())
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.scheduler.pool.num_free == blocks
    assert [r.token_ids for r in results] == expected
    for result, theirs in zip(results, hf_logprobs, strict=True):
        assert len(result.logprobs) == NEW_TOKENS
        for step, entries in enumerate(result.logprobs):
            ids = torch.tensor([token for token, _ in entries])
            ours = torch.tensor([logprob for _, logprob in entries])
            torch.testing.assert_close(ours, theirs[step][ids], atol=1e-4, rtol=0)


def test_several_eos_ids_end_generation_as_transformers_does(tmp_path: Path) -> None:
    """Llama 3.x ends at any of several ids (<|end_of_text|>, <|eom_id|>, <|eot_id|>), read
    from generation_config.json."""
    import torch
    import transformers

    model = _checkpoint("llama3")
    model.save_pretrained(tmp_path)
    expected, _ = _hf_generate(model)
    eos = [model.config.eos_token_id, expected[0][5], expected[2][9]]
    transformers.GenerationConfig(eos_token_id=eos).save_pretrained(tmp_path)
    with torch.inference_mode():
        stopped = [
            model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           eos_token_id=eos, pad_token_id=0)[0, len(ids):].tolist()
            for ids in PROMPTS
        ]  # fmt: skip
    engine = OfflineEngine(build(RunnerConfig, model=str(tmp_path), dtype="float32"))
    ends = engine.generate([replace(r, ignore_eos=False) for r in _requests(None)])
    assert [r.token_ids for r in ends] == stopped
    assert ends[0].finish_reason == ends[2].finish_reason == "stop"


@pytest.mark.parametrize(
    ("family", "positions"),
    [("phi3", [3, 200, 255, 256, 300, 511]), ("dynamic", [3, 95, 96, 97, 150, 191])],
)
def test_a_scaled_rope_rotates_each_position_as_transformers_does(
    family: str, positions: list[int], tmp_path: Path
) -> None:
    """Longrope: positions 0-255 by the short factors, 256 on by the long ones, each times the
    attention factor. Dynamic NTK: from the original 96 positions on, each position by the
    frequencies of a sequence that long. Against transformers' rotary embedding asked for each
    position in turn, as `generate` asks for each new token's."""
    import torch

    from turnstile.executor_svc.model.rope import rope_rotations
    from turnstile.shared.model_info import read_model_info

    model = _checkpoint(family)
    model.save_pretrained(tmp_path)
    rotations = rope_rotations(read_model_info(tmp_path))
    for position in positions:
        cos, sin = model.model.rotary_emb(torch.zeros(1, 1, 128), torch.tensor([[position]]))
        half = cos.shape[-1] // 2
        ours = rotations[position]
        torch.testing.assert_close(ours.real, cos[0, 0, :half], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.imag, sin[0, 0, :half], atol=1e-5, rtol=1e-5)


def test_a_sharded_folder_loads_the_shards_its_index_names(tmp_path: Path) -> None:
    """Mistral's repositories hold `consolidated.safetensors` beside the sharded checkpoint:
    the same weights under Mistral's own names, which loading every file would hold twice. A
    shard the index names but the folder lacks is named."""
    import torch
    from safetensors.torch import save_file

    from turnstile.executor_svc.model.weights import load_weights
    from turnstile.shared.model_info import read_model_info

    model = _checkpoint("mistral")
    model.save_pretrained(tmp_path, max_shard_size="300KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    save_file({"layers.0.attention.wq.weight": torch.zeros(128, 128)},
              tmp_path / "consolidated.safetensors")  # fmt: skip
    weights = load_weights(tmp_path, read_model_info(tmp_path))
    assert weights.keys() == model.state_dict().keys()
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1].name):
        load_weights(tmp_path, read_model_info(tmp_path))
