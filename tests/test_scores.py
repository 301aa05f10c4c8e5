"""vLLM's /score, /rerank and /classify through a real stack, on tiny random Qwen3 sequence
classifiers (`random_llama.classifier`) held to transformers' `AutoModelForSequenceClassification`
on the tokenizer's own pair encoding: one label (a cross-encoder: sigmoid scores), three
(softmax probabilities). Bi-encoder scores (an embedding model's cosines) are in
`test_embeddings.py`, on its stack."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests

from turnstile.bench import random_llama
from turnstile.bench.server_process import Server, launched_server
from turnstile.shared.config import EngineConfig

pytestmark = pytest.mark.slow  # starts stacks

QUERY = "w5 w6 w7"
DOCS = ["w8 w9", " ".join(f"w{i}" for i in range(20, 70)), "w5 w6", "w40 w41 w42"]  # 2nd chunked
LABELS = ("negative", "neutral", "positive")


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_llama.classifier(tmp_path_factory.mktemp("reranker"))


@pytest.fixture(scope="module")
def server(reranker: Path) -> Iterator[Server]:
    with launched_server(
        "--model", str(reranker), "--dtype", "float32", "--served-model-name", "reranker",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
    ) as server:  # fmt: skip
        yield server


def logits(model: Path, pairs: list[tuple[str, ...]]) -> np.ndarray:
    """transformers' logits of each text or pair, as its tokenizer encodes it."""
    import torch
    import transformers

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    with torch.no_grad():
        rows = [hf(**tokenizer(*pair, return_tensors="pt")).logits[0] for pair in pairs]
    return torch.stack(rows).numpy()


def post(server: Server, path: str, body: dict) -> dict:
    answer = requests.post(f"{server.url}{path}", json={"model": "reranker", **body}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def pair_tokens(first: str, second: str) -> int:
    """A pair's prompt length: a token a word, each text closed by w2."""
    return len(first.split()) + len(second.split()) + 2


def test_pairs_score_as_transformers_does(reranker: Path, server: Server) -> None:
    expected = 1 / (1 + np.exp(-logits(reranker, [(QUERY, doc) for doc in DOCS])[:, 0]))
    answer = post(server, "/score", {"text_1": QUERY, "text_2": DOCS})
    assert answer["object"] == "list" and answer["id"].startswith("score-")
    assert [item["index"] for item in answer["data"]] == list(range(len(DOCS)))
    found = [item["score"] for item in answer["data"]]
    np.testing.assert_allclose(found, expected, atol=2e-5)
    tokens = sum(pair_tokens(QUERY, doc) for doc in DOCS)
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] == tokens
    pairwise = post(server, "/v1/score", {"queries": [QUERY, DOCS[0]], "documents": DOCS[:2]})
    expected_pairs = logits(reranker, [(QUERY, DOCS[0]), (DOCS[0], DOCS[1])])[:, 0]
    scores = [item["score"] for item in pairwise["data"]]
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-expected_pairs)), atol=2e-5)
    bare = post(server, "/score", {"data_1": QUERY, "data_2": DOCS[0], "use_activation": False})
    np.testing.assert_allclose(bare["data"][0]["score"], expected_pairs[0], atol=2e-5)


def test_rerank_orders_the_documents(reranker: Path, server: Server) -> None:
    expected = 1 / (1 + np.exp(-logits(reranker, [(QUERY, doc) for doc in DOCS])[:, 0]))
    order = list(np.argsort(-expected))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        answer = post(server, path, {"query": QUERY, "documents": DOCS, "top_n": 2})
        results = answer["results"]
        assert [r["index"] for r in results] == order[:2]
        assert [r["document"]["text"] for r in results] == [DOCS[i] for i in order[:2]]
        found = [r["relevance_score"] for r in results]
        np.testing.assert_allclose(found, expected[order[:2]], atol=2e-5)
    whole = post(server, "/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False})
    assert [r["index"] for r in whole["results"]] == order
    assert [r["document"] for r in whole["results"]] == [None] * len(DOCS)  # Jina's field
    # Each document's first 2 tokens, as vLLM cuts them: scored as the cut text is
    cut = post(server, "/rerank", {"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 2})
    short = [" ".join(doc.split()[:2]) for doc in DOCS]
    again = 1 / (1 + np.exp(-logits(reranker, [(QUERY, doc) for doc in short])[:, 0]))
    by_index = {r["index"]: r["relevance_score"] for r in cut["results"]}
    np.testing.assert_allclose([by_index[i] for i in range(len(DOCS))], again, atol=2e-5)


def test_cohere_clients_rerank(reranker: Path, server: Server) -> None:
    """Cohere's official client, as vLLM's docs use it: V2 on /v2/rerank, V1 on /v1/rerank."""
    import cohere

    expected = 1 / (1 + np.exp(-logits(reranker, [(QUERY, doc) for doc in DOCS])[:, 0]))
    best = list(np.argsort(-expected))[:2]
    for client in (cohere.ClientV2, cohere.Client):
        answer = client(api_key="x", base_url=server.url).rerank(
            model="reranker", query=QUERY, documents=DOCS, top_n=2
        )
        assert [result.index for result in answer.results] == best
        found = [result.relevance_score for result in answer.results]
        np.testing.assert_allclose(found, expected[best], atol=2e-5)


def test_one_label_classifies_by_its_sigmoid(reranker: Path, server: Server) -> None:
    expected = 1 / (1 + np.exp(-logits(reranker, [(QUERY,), ("w9 w8",)])[:, 0]))
    answer = post(server, "/classify", {"input": [QUERY, "w9 w8"]})
    assert answer["id"].startswith("classify-")
    assert [item["label"] for item in answer["data"]] == ["relevant", "relevant"]
    assert [item["num_classes"] for item in answer["data"]] == [1, 1]
    np.testing.assert_allclose([d["probs"][0] for d in answer["data"]], expected, atol=2e-5)
    by_ids = post(server, "/classify", {"input": [5, 6, 7, 2]})  # QUERY's tokens
    np.testing.assert_allclose(by_ids["data"][0]["probs"][0], expected[0], atol=2e-5)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": QUERY}, "model"),  # a classifier: no embeddings
        ("/v1/completions", {"prompt": QUERY}, "model"),  # ... and no generation
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ("/score", {"text_1": [QUERY] * 2, "text_2": DOCS}, "queries"),  # 2 queries, 4 docs
        ("/score", {"text_1": QUERY, "documents": DOCS}, "queries"),  # sides of two kinds
        ("/score", {"queries": QUERY, "documents": []}, "documents"),
        ("/score", {"queries": QUERY, "documents": [{"content": []}]}, "documents[0]"),  # images
        ("/score", {"queries": QUERY, "documents": DOCS, "instruction": "x"}, "instruction"),
        (
            "/rerank",
            {"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 512},
            "max_tokens_per_doc",
        ),
        ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
        ("/rerank", {"query": "w5 " * 600, "documents": DOCS}, "documents"),  # over the context
        ("/classify", {"input": [[5, 512]]}, "input"),  # outside the vocabulary
    ],
)
def test_what_is_refused_is_named(server: Server, path: str, body: dict, param: str) -> None:
    answer = requests.post(f"{server.url}{path}", json={"model": "reranker", **body}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_nothing_refused_keeps_a_block(server: Server) -> None:
    """After every answer and refusal above, the KV cache holds no request's blocks (once the
    scheduler's gauges, published every 0.5 s, catch up)."""
    deadline = time.monotonic() + 10
    while True:
        series = server.scrape()
        idle = series["turnstile:num_requests_running"] == 0
        if (
            idle
            and series["turnstile:kv_cache_free_blocks"]
            == series["turnstile:kv_cache_total_blocks"]
        ):
            return
        assert time.monotonic() < deadline, f"blocks still held: {series}"
        time.sleep(0.2)


def test_three_labels_softmax(tmp_path: Path) -> None:
    model = random_llama.classifier(tmp_path, LABELS)
    texts = [QUERY, DOCS[1]]
    expected = logits(model, [(text,) for text in texts])
    with launched_server("--model", str(model), "--dtype", "float32") as server:
        url = f"{server.url}/classify"
        answer = requests.post(url, json={"input": texts}, timeout=60).json()
        raw = requests.post(url, json={"input": texts, "use_activation": False}).json()
        refused = requests.post(f"{server.url}/score", json={"text_1": "a", "text_2": "b"})
    probs = np.exp(expected) / np.exp(expected).sum(axis=1, keepdims=True)
    np.testing.assert_allclose([d["probs"] for d in answer["data"]], probs, atol=2e-5)
    assert [d["label"] for d in answer["data"]] == [LABELS[i] for i in probs.argmax(axis=1)]
    np.testing.assert_allclose([d["probs"] for d in raw["data"]], expected, atol=2e-5)
    assert refused.status_code == 400 and "3 labels" in refused.json()["error"]["message"]


# An LLM reranker's template, as Qwen3-Reranker's: the instruction, query and document between
# markers, the model's next token "yes" (w11) or "no" (w10).
RERANKER_TEMPLATE = (
    "w3 {{ instruction | default('w4') }} {% for m in messages %}"
    "{{ 'w7' if m.role == 'query' else 'w8' }} {{ m.content }} {% endfor %}w9"
)
AS_RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["w10", "w11"], "is_original_qwen3_reranker": True,
}  # fmt: skip


def test_an_original_reranker_scores_yes_against_no(tmp_path: Path) -> None:
    """Qwen3-Reranker as vLLM's docs serve it: a language model made a classifier by
    --hf-overrides, its pairs written by --chat-template; a pair's score is the softmax of its
    next token's "yes" and "no" logits (transformers' `AutoModelForCausalLM`)."""
    import json

    import tokenizers
    import torch
    import transformers

    model = random_llama.write(
        tmp_path / "reranker", "Qwen3", **random_llama.TINY_QWEN3, tie_word_embeddings=False
    )
    written = [f"w3 {instruction} w7 {QUERY} w8 {doc} w9" for instruction in ("w4", "w12")
               for doc in DOCS]  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    words = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    with torch.no_grad():
        last = [hf(torch.tensor([words.encode(text).ids])).logits[0, -1] for text in written]
    expected = [torch.softmax(row[[10, 11]], dim=0)[1].item() for row in last]
    flags = ["--hf-overrides", json.dumps(AS_RERANKER), "--chat-template", RERANKER_TEMPLATE]
    with launched_server("--model", str(model), "--dtype", "float32", *flags) as server:
        scores = []
        for extra in ({}, {"instruction": "w12"}):
            body = {"query": QUERY, "documents": DOCS, **extra}
            answer = requests.post(f"{server.url}/rerank", json=body, timeout=60).json()
            by_index = {r["index"]: r["relevance_score"] for r in answer["results"]}
            scores += [by_index[i] for i in range(len(DOCS))]
        tokens = sum(len(text.split()) for text in written[: len(DOCS)])
        assert answer["usage"]["prompt_tokens"] == tokens
        chat = {"messages": [{"role": "user", "content": "w5"}]}
        refused = requests.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    np.testing.assert_allclose(scores, expected, atol=2e-5)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    with launched_server("--model", str(model), "--runner", "generate") as server:
        pooled = requests.post(f"{server.url}/score", json={"text_1": "w5", "text_2": "w6"})
        body = {"prompt": "w5", "max_tokens": 2, "ignore_eos": True}
        generated = requests.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert pooled.status_code == 400 and "--runner generate" in pooled.json()["error"]["message"]
    assert generated.status_code == 200


def test_runner_pooling_and_convert_embed(reranker: Path) -> None:
    """vLLM's --runner pooling --convert embed on a classifier's checkpoint: its embeddings
    (the last token's final hidden state, normalized: transformers' `AutoModel`), no classes,
    no generation. --runner generate refuses a classifier at start."""
    import torch
    import transformers

    with torch.no_grad():
        base = transformers.AutoModel.from_pretrained(reranker, dtype=torch.float32)
        last = base(torch.tensor([[5, 6, 7, 2]])).last_hidden_state[0, -1]
    expected = torch.nn.functional.normalize(last, dim=0).numpy()
    flags = ["--runner", "pooling", "--convert", "embed"]
    with launched_server("--model", str(reranker), "--dtype", "float32", *flags) as server:
        answer = requests.post(f"{server.url}/v1/embeddings", json={"input": QUERY}, timeout=60)
        classes = requests.post(f"{server.url}/classify", json={"input": QUERY}, timeout=60)
        body = {"prompt": "w5", "max_tokens": 2}
        generated = requests.post(f"{server.url}/v1/completions", json=body, timeout=60)
    np.testing.assert_allclose(answer.json()["data"][0]["embedding"], expected, atol=2e-5)
    assert classes.status_code == 400 and "not a sequence classifier" in classes.text
    assert generated.status_code == 400 and "--runner pooling" in generated.text
    with pytest.raises(ValueError, match="--runner generate"):
        EngineConfig(model=str(reranker), runner="generate").model_info()
    import torch

    from turnstile.executor_svc.model.classifier import classifier_head

    info = EngineConfig(model=str(reranker), convert="classify").model_info()
    assert info.labels == ("relevant",)  # already one: its own head
    with pytest.raises(ValueError, match=r"score\.weight"):  # a language model's: none
        classifier_head(info, {"lm_head.weight": torch.zeros(4, 2)}, torch.device("cpu"))
