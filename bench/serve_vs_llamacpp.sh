#!/usr/bin/env bash
# Serving throughput of Turnstile and llama.cpp's `llama-server` on the same GGUF file (the
# embedded model, or $GGUF: a file with the embedded model's tokenizer, as
# bench/random_moe_gguf.py writes one), with vLLM's client (`vllm bench serve` from
# ../shared/peers/setup.sh's venv; random 128 in / 128 out), alternating A B A B. llama-server
# is built once, with this CPU's flags, from the llama.cpp sources inside PyPI's
# llama-cpp-python sdist (no GitHub here).
#   usage: bench/serve_vs_llamacpp.sh [ROUNDS=3] [NUM_PROMPTS=64] [extra bench args]
# Throughput is prompts x 128 / duration: both servers generate all 128 tokens (ignore_eos),
# while the client's own count re-tokenizes llama-server's text and finds fewer.
set -euo pipefail
rounds=${1:-3}; prompts=${2:-64}; shift $(( $# > 2 ? 2 : $# )) || true
P=${PEERS:-$HOME/.cache/turnstile-peers}; length=128  # tokens in, and out
source "$(dirname "$0")"/llama_cpp.sh
out=$(mktemp -d); ts_pid=; l_pid=
cleanup() { [ -n "$ts_pid" ] && kill -TERM "$ts_pid" 2>/dev/null; [ -n "$l_pid" ] && kill -TERM "$l_pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
gguf=${GGUF:-$(.venv/bin/python -c 'from turnstile.shared.model_info import embedded_model_path as p; print(p())')}
# 64 slots of 512 tokens, continuous batching (its default), both cores for decode and prefill.
"$server" -m "$gguf" --host 127.0.0.1 --port 8100 -c 32768 -np 64 -t 2 -tb 2 --alias smollm2 \
  > "$out"/llama.log 2>&1 & l_pid=$!
.venv/bin/turnstile serve ${GGUF:+--model "$GGUF"} --host 127.0.0.1 --port 8000 > "$out"/turnstile.log 2>&1 & ts_pid=$!
for url in http://127.0.0.1:8000/health http://127.0.0.1:8100/health; do
  for _ in $(seq 600); do curl -sf "$url" >/dev/null && break; sleep 1; done
done
bench() {  # name port model seed [bench args]
  "$P"/bin/vllm bench serve --seed "$4" --backend vllm --base-url "http://127.0.0.1:$2" --model "$3" \
    --tokenizer "$P"/smollm2-hf --dataset-name random --random-input-len $length --random-output-len $length \
    --num-prompts "$prompts" --request-rate inf --ignore-eos "${@:5}" --save-result \
    --result-dir "$out" --result-filename "$1.json" > "$out/$1.txt" 2>&1 || { tail -n 5 "$out/$1.txt"; return 1; }
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"{sys.argv[2]:<14} {int(sys.argv[3]) * d['completed'] / d['duration']:8.1f} tok/s  TTFT p50 {d['median_ttft_ms']:8.0f} ms\")" "$out/$1.json" "$1" $length
}
ts_model=$(curl -s http://127.0.0.1:8000/v1/models | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
# A warm-up of each (not counted); each round draws new random prompts (its own --seed).
prompts_saved=$prompts; prompts=8
bench warmup-turnstile 8000 "$ts_model" 1000 "$@" >/dev/null; bench warmup-llama 8100 smollm2 1000 "$@" >/dev/null
prompts=$prompts_saved
for r in $(seq "$rounds"); do
  bench "turnstile-$r" 8000 "$ts_model" "$r" "$@"
  bench "llamacpp-$r" 8100 smollm2 "$r" "$@"
done
python3 - "$out" "$rounds" $length <<'PY'
import json, re, statistics, sys
out, n, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def rate(name):
    d = json.load(open(f"{out}/{name}.json"))
    return length * d["completed"] / d["duration"]
t = [rate(f"turnstile-{r}") for r in range(1, n + 1)]
v = [rate(f"llamacpp-{r}") for r in range(1, n + 1)]
print(f"median output tok/s: turnstile {statistics.median(t):.1f}, llama.cpp {statistics.median(v):.1f}, "
      f"ratio {statistics.median(t) / statistics.median(v):.2f} (rounds: {', '.join(f'{a / b:.2f}' for a, b in zip(t, v))})")
# llama-server's own time a generated token, from its log's line for each request.
log = open(f"{out}/llama.log").read()
runs = re.findall(r"(?<!prompt) eval time = .*?/\s*(\d+) tokens \(\s*([\d.]+) ms per token", log)
assert {int(tokens) for tokens, _ in runs} == {length}, "llama-server stopped a request short"
ms = statistics.median(float(each) for _, each in runs)
print(f"llama-server's own decode, median of {len(runs)} requests: {ms:.2f} ms a token")
PY
echo "results and logs: $out"
