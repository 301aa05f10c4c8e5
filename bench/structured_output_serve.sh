#!/usr/bin/env bash
# Structured output's cost, served: one `turnstile serve`, loaded by `turnstile bench serve`
# (random 128 in / 128 out, 64 at once) without and with --structured-output (every answer held
# to a JSON schema of at least 64 items, so the grammar constrains each token), alternating
# A B A B. Each run draws its own prompts (a reused prompt would hit the prefix cache). Prints
# output tok/s and TPOT p50 per run, then the grammar's host time from the service's /metrics.
#   usage: bench/structured_output_serve.sh [ROUNDS=3] [extra serve flags]
set -euo pipefail
rounds=${1:-3}; shift $(( $# > 0 ? 1 : 0 )) || true
port=18123; out=$(mktemp -d)
.venv/bin/turnstile serve --port $port "$@" > "$out/serve.log" 2>&1 &
pid=$!
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
# Warm-up: the first constrained request loads xgrammar and compiles the schema.
.venv/bin/turnstile bench serve --url "http://127.0.0.1:$port" --num-prompts 4 --output-len 16 \
  --structured-output > /dev/null 2>&1
for round in $(seq "$rounds"); do
  for mode in free structured; do
    flag=(); [ "$mode" = structured ] && flag=(--structured-output)
    seed=$((round * 10 + ${#mode}))
    .venv/bin/turnstile bench serve --url "http://127.0.0.1:$port" --input-len 128 \
      --output-len 128 --num-prompts 64 --concurrency 64 --seed $seed "${flag[@]}" \
      --result-json "$out/$mode$round.json" > /dev/null 2>&1
    .venv/bin/python -c "import json, sys; s = json.load(open(sys.argv[2]))['summary']
print(f\"round {sys.argv[1]} {sys.argv[3]}: {s['output_throughput']:.1f} output tok/s, \"
      f\"TPOT p50 {s['tpot_ms']['p50']:.1f} ms\")" "$round" "$out/$mode$round.json" "$mode"
  done
done
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^turnstile:(grammar_mask_seconds|executor_forward_seconds)_(sum|count)'
kill -TERM $pid; wait $pid 2>/dev/null || true
