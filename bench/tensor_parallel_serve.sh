#!/usr/bin/env bash
# Tensor parallelism served: TP=1 against TP=N on the same model, alternating A B A B, each a
# fresh `turnstile serve` loaded by `turnstile bench serve` (random prompts, all at once). Prints
# output tok/s, TPOT p50 and the executor's mean step time (its own /metrics) per run.
#   usage: bench/tensor_parallel_serve.sh [N=3] [ROUNDS=2] [extra serve flags, e.g. --model DIR]
set -euo pipefail
ranks=${1:-3}; rounds=${2:-2}; shift $(( $# > 2 ? 2 : $# )) || true
out=$(mktemp -d)
for _ in $(seq "$rounds"); do
  for tp in 1 "$ranks"; do
    port=$((18000 + tp)); mport=$((19000 + tp))
    .venv/bin/turnstile serve --port $port --metrics-port $mport --tensor-parallel-size "$tp" "$@" \
      > "$out/serve$tp.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
    .venv/bin/turnstile bench serve --url "http://127.0.0.1:$port" --num-prompts 32 --input-len 128 \
      --output-len 64 --result-json "$out/tp$tp.json" > "$out/bench$tp.txt" 2>&1
    .venv/bin/python - "$tp" "$out/tp$tp.json" $((mport + 1)) <<'PY'
import json, sys, urllib.request
tp, path, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
summary = json.load(open(path))["summary"]
text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
series = {l.split()[0]: float(l.split()[1]) for l in text.splitlines()
          if l.startswith("turnstile:executor_forward_seconds_")}
steps = series["turnstile:executor_forward_seconds_count"]
mean = 1000 * series["turnstile:executor_forward_seconds_sum"] / steps
print(f"TP={tp}: {summary['output_throughput']:.1f} output tok/s, TPOT p50 "
      f"{summary['tpot_ms']['p50']:.1f} ms, executor step {mean:.1f} ms mean over {int(steps)}")
PY
    kill -TERM $pid; wait $pid 2>/dev/null || true
  done
done
