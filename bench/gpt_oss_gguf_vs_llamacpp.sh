#!/usr/bin/env bash
# gpt-oss as llama.cpp users run it: a random gpt-oss checkpoint in MXFP4 with gpt-oss-20b's
# layers (`bench/random_gpt_oss.py`; random weights, for speed and agreement only), converted to
# GGUF by llama.cpp's own convert_hf_to_gguf.py (bf16, the experts in MXFP4). First what
# Turnstile computes from the file against the checkpoint (prompt logprobs, greedy tokens), and
# llama-server's greedy tokens from the file; then both served, bench/serve_vs_llamacpp.sh.
#   usage: bench/gpt_oss_gguf_vs_llamacpp.sh [LAYERS=4] [serve_vs_llamacpp.sh's arguments]
set -euo pipefail
layers=${1:-4}; shift $(( $# > 0 ? 1 : 0 ))
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d); pids=()
source "$(dirname "$0")"/llama_cpp.sh
cleanup() { for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done; wait 2>/dev/null || true; }
trap cleanup EXIT
.venv/bin/python -m turnstile.bench.random_gpt_oss "$out/hf" "$P"/smollm2-hf "$layers"
.venv/bin/python "$src"/convert_hf_to_gguf.py "$out/hf" --outfile "$out/gpt-oss.gguf" --outtype bf16 \
  > "$out/convert.log" 2>&1 || { tail -n 20 "$out/convert.log"; exit 1; }
ready() { for _ in $(seq 900); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return; sleep 1; done; return 1; }
# One at a time: their loads' transients together could exhaust the memory.
.venv/bin/turnstile serve --model "$out/hf" --host 127.0.0.1 --port 8000 > "$out/hf.log" 2>&1 & pids+=($!)
ready 8000
.venv/bin/turnstile serve --model "$out/gpt-oss.gguf" --host 127.0.0.1 --port 8001 > "$out/gguf.log" 2>&1 & pids+=($!)
ready 8001
"$server" -m "$out/gpt-oss.gguf" --host 127.0.0.1 --port 8100 -c 4096 -np 1 -t 2 > "$out/llama.log" 2>&1 & pids+=($!)
ready 8100
.venv/bin/python - <<'PY'
import json, statistics, urllib.request
def post(port, path, body):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=600))
def model(port):
    return json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models"))["data"][0]["id"]
def complete(port, **body):
    return post(port, "/v1/completions", {"model": model(port), **body})["choices"][0]
text = open("README.md").read()[300:1500]
ours, theirs = ([next(iter(e.values()))["logprob"] for e in complete(port, prompt=text, max_tokens=1,
                 prompt_logprobs=0)["prompt_logprobs"][1:]] for port in (8001, 8000))
d = [abs(x - y) for x, y in zip(ours, theirs, strict=True)]
print(f"the GGUF file against the checkpoint: prompt logprobs of {len(d)} tokens differ by "
      f"{statistics.mean(d):.2e} on average, {max(d):.2e} at most")
for prompt in ["Write a list of fruits:", "The capital of France is", "def fibonacci(n):"]:
    file, checkpoint = (complete(port, prompt=prompt, max_tokens=32, temperature=0, ignore_eos=True,
                                 return_token_ids=True)["token_ids"] for port in (8001, 8000))
    llama = post(8100, "/completion", {"prompt": prompt, "n_predict": 32, "temperature": 0,
                                       "ignore_eos": True, "return_tokens": True})["tokens"]
    same = lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    print(f"  {prompt!r:<28} greedy tokens equal: the checkpoint's {same(file, checkpoint)} of 32, "
          f"llama-server's {same(file, llama)} of 32")
PY
cleanup; pids=()
GGUF="$out/gpt-oss.gguf" "$(dirname "$0")"/serve_vs_llamacpp.sh "$@"
