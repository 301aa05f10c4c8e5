# Sourced by the bench/*_vs_vllm.sh scripts: vLLM's own client (`vllm bench serve`, from
# ../shared/peers/setup.sh's venv in $P) against one server, its result kept in $out.
#   serve_bench NAME PORT SEED [vllm bench serve args]: $out/NAME.json, and a line printed
serve_bench() {
  "$P"/bin/vllm bench serve --seed "$3" --backend vllm --base-url "http://127.0.0.1:$2" "${@:4}" \
    --save-result --result-dir "$out" --result-filename "$1.json" > "$out/$1.txt" 2>&1 \
    || { tail -n 5 "$out/$1.txt"; return 1; }
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"{sys.argv[2]:<14} {d['output_throughput']:7.1f} output tok/s  TPOT p50 {d['median_tpot_ms']:6.1f} ms  TTFT p50 {d['median_ttft_ms']:7.0f} ms\")" "$out/$1.json" "$1"
}
#   random_bench NAME PORT SEED COUNT [bench args]: random 128/128 of $model, $concurrency at once
random_bench() {
  serve_bench "$1" "$2" "$3" --model "$model" --tokenizer "$model" --dataset-name random \
    --random-input-len 128 --random-output-len 128 --ignore-eos --num-prompts "$4" \
    --max-concurrency "$concurrency" --request-rate inf "${@:5}"
}
#   alternate ROUNDS COUNT [bench args]: a warm-up of each, then rounds alternating turnstile-R
#   (port 8000) and vllm-R (port 8100), COUNT requests each, through the caller's
#   `bench NAME PORT SEED COUNT [bench args]`
alternate() {
  bench warmup-turnstile 8000 1000 8 "${@:3}" >/dev/null
  bench warmup-vllm 8100 1000 8 "${@:3}" >/dev/null
  for r in $(seq "$1"); do
    bench "turnstile-$r" 8000 "$r" "$2" "${@:3}"
    bench "vllm-$r" 8100 "$r" "$2" "${@:3}"
  done
}
#   medians ROUNDS: each server's median output tok/s over `alternate`'s rounds, and their ratio
medians() {
  python3 - "$out" "$1" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
tok = {n: [json.load(open(f"{out}/{n}-{r}.json"))["output_throughput"] for r in range(1, rounds + 1)]
       for n in ("turnstile", "vllm")}
ratios = [a / b for a, b in zip(tok["turnstile"], tok["vllm"])]
print(f"median output tok/s: turnstile {statistics.median(tok['turnstile']):.1f}, vLLM-CPU "
      f"{statistics.median(tok['vllm']):.1f}; ratio {statistics.median(ratios):.2f}x "
      f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})")
PY
}
#   start_pair MODEL "TURNSTILE FLAGS" "VLLM FLAGS": both servers on MODEL (Turnstile on port
#   8000, vLLM on 8100; logs in $out, pids in $ts_pid and $v_pid), once both answer /health;
#   stop_pair ends them
start_pair() {
  .venv/bin/turnstile serve --host 127.0.0.1 --port 8000 --model "$1" --served-model-name "$1" \
    $2 > "$out"/turnstile.log 2>&1 & ts_pid=$!
  "$P"/bin/vllm serve "$1" --host 127.0.0.1 --port 8100 --max-model-len 2048 $3 \
    > "$out"/vllm.log 2>&1 & v_pid=$!
  for url in http://127.0.0.1:8000/health http://127.0.0.1:8100/health; do
    for _ in $(seq 600); do curl -sf "$url" >/dev/null && break; sleep 1; done
  done
}
stop_pair() { kill -TERM "$ts_pid" "$v_pid"; wait "$ts_pid" "$v_pid" 2>/dev/null || true; ts_pid=; v_pid=; }
