"""Encoder-only models (BERT, XLM-RoBERTa) through real stacks, on tiny random ones
(`bench/random_encoder.py`) held to transformers: a BERT embedder (sentence-transformers' mean
pooling, normalized) through the official openai client and /score; a BERT cross-encoder, whose
pairs' second texts are typed 1, through /rerank and /score (truncated from the left too), and
/classify. Each prompt runs whole: the steps here hold fewer tokens than the prompts sent
together. An XLM-RoBERTa classifier's step: `test_encoder_support.py`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

from turnstile.bench import random_encoder
from turnstile.bench.server_process import Server, launched_server

pytestmark = pytest.mark.slow  # starts stacks


def words(first: int, end: int) -> str:
    return " ".join(f"w{i}" for i in range(first, end))


TEXTS = [words(10, 90), "w5 w6 w7", words(100, 170)]
QUERY = "w5 w6 w7 w8"
DOCS = ["w8 w9", words(20, 90), "w5 w6", "w40 w41 w42"]
# Steps of 128 tokens: the first and third texts (82, 72 tokens) cannot share one.
STACK = ("--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "128",
         "--max-num-batched-tokens", "128")  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    made = tmp_path_factory.mktemp("encoders")
    return {
        # positions for its context only: an input of the whole context reads the last one
        "embedder": random_encoder.encoder(made / "embedder", pooling="mean",
                                           max_position_embeddings=128),
        "cross": random_encoder.encoder(made / "cross", head="ForSequenceClassification",
                                        num_labels=1),
        "modern": random_encoder.encoder(made / "modern", "ModernBert",
                                         "ForSequenceClassification", num_labels=1,
                                         classifier_pooling="mean"),
    }  # fmt: skip


def served(folder: Path, name: str) -> Iterator[Server]:
    with launched_server("--model", str(folder), "--served-model-name", name, *STACK) as server:
        yield server


@pytest.fixture(scope="module")
def embedder(folders: dict[str, Path]) -> Iterator[Server]:
    yield from served(folders["embedder"], "embedder")


@pytest.fixture(scope="module")
def cross(folders: dict[str, Path]) -> Iterator[Server]:
    yield from served(folders["cross"], "cross")


def post(server: Server, path: str, body: dict) -> requests.Response:
    return requests.post(f"{server.url}{path}", json=body, timeout=60)


def hf(folder: Path, kind: str) -> tuple:
    import torch
    import transformers

    model = getattr(transformers, kind).from_pretrained(folder, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder)


def mean_pooled(folder: Path, texts: list[str], keep: int | None = None) -> np.ndarray:
    """sentence-transformers' vectors: the final states' mean, normalized; with `keep`, of each
    text truncated to `keep` tokens by its tokenizer (as sentence-transformers cuts it)."""
    import torch

    model, tokenizer = hf(folder, "AutoModel")
    cut = {"truncation": True, "max_length": keep} if keep else {}
    with torch.no_grad():
        rows = [model(**tokenizer(text, return_tensors="pt", **cut)).last_hidden_state[0].mean(0)
                for text in texts]  # fmt: skip
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy()


def test_a_bert_embedders_vectors_are_sentence_transformers_mean_pooled(
    folders: dict[str, Path], embedder: Server
) -> None:
    client = openai.OpenAI(base_url=f"{embedder.url}/v1", api_key="x", max_retries=0)
    answer = client.embeddings.create(model="embedder", input=TEXTS)
    got = np.array([item.embedding for item in answer.data])
    np.testing.assert_allclose(got, mean_pooled(folders["embedder"], TEXTS), atol=2e-5)
    assert answer.usage.prompt_tokens == sum(len(t.split()) + 2 for t in TEXTS)  # [CLS], [SEP]
    scores = post(embedder, "/score", {"queries": QUERY, "documents": DOCS[:2]}).json()
    vectors = mean_pooled(folders["embedder"], [QUERY, *DOCS[:2]])
    expected = vectors[1:] @ vectors[0]
    np.testing.assert_allclose([r["score"] for r in scores["data"]], expected, atol=2e-5)


def test_an_input_may_fill_the_context_and_is_truncated_to_it(
    folders: dict[str, Path], embedder: Server
) -> None:
    """As vLLM: a pooled input of the whole context (128 tokens here, its last position the
    model's last) is embedded, and `truncate_prompt_tokens: -1` keeps that much of a longer one,
    as its tokenizer cuts it ([CLS], the first 126 words, [SEP])."""
    whole, longer = words(10, 136), words(10, 200)  # 126 and 190 words, [CLS] and [SEP] besides
    answer = post(embedder, "/v1/embeddings", {"model": "embedder", "input": [whole, longer],
                                               "truncate_prompt_tokens": -1}).json()  # fmt: skip
    assert answer["usage"]["prompt_tokens"] == 2 * 128
    got = np.array([item["embedding"] for item in answer["data"]])
    expected = mean_pooled(folders["embedder"], [whole, longer], keep=128)
    np.testing.assert_allclose(got, expected, atol=2e-5)


def test_an_encoder_generates_nothing_and_refuses_a_prompt_past_its_context(
    embedder: Server,
) -> None:
    for path, body in (("/v1/completions", {"prompt": "w5", "max_tokens": 2}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "w5"}]})):  # fmt: skip
        answer = post(embedder, path, {"model": "embedder", **body})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "model"
        assert "encoder" in answer.json()["error"]["message"]
    answer = post(embedder, "/v1/embeddings", {"model": "embedder", "input": words(10, 137)})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input"
    assert "129 tokens: an input takes 1 to 128" in answer.json()["error"]["message"]


def cross_logits(
    folder: Path, pairs: list[tuple[str, ...]], keep: int = 0, last: bool = False
) -> np.ndarray:
    """transformers' logit of each pair (or text) as BERT's tokenizer types it; with `keep`,
    truncated by the tokenizer to `keep` tokens (as a cross-encoder is), or (`last`) its last
    `keep` tokens (and their types)."""
    import torch

    model, tokenizer = hf(folder, "AutoModelForSequenceClassification")
    rows = []
    cut = {"truncation": True, "max_length": keep} if keep and not last else {}
    with torch.no_grad():
        for pair in pairs:
            encoded = tokenizer(*pair, return_tensors="pt", **cut)
            assert encoded["token_type_ids"].any() == (len(pair) == 2)  # a second text: type 1
            if last:
                encoded = {name: value[:, -keep:] for name, value in encoded.items()}
            rows.append(model(**encoded).logits[0, 0])
    return torch.stack(rows).numpy()


def reranked_as(server: Server, name: str, expected: np.ndarray) -> None:
    """/rerank of QUERY and DOCS: the documents in `expected`'s order, with its scores."""
    answer = post(server, "/rerank", {"model": name, "query": QUERY, "documents": DOCS})
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected))
    got = {r["index"]: r["relevance_score"] for r in results}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], expected, atol=2e-5)


def test_a_bert_cross_encoder_reads_its_pairs_second_text_as_type_one(
    folders: dict[str, Path], cross: Server
) -> None:
    pairs = [(QUERY, doc) for doc in DOCS]
    reranked_as(cross, "cross", 1 / (1 + np.exp(-cross_logits(folders["cross"], pairs))))
    # Each pair cut to 12 tokens as its tokenizer cuts it (as vLLM), the longer text first:
    # [CLS] query [SEP] document [SEP]; or to its last 5 (truncation_side left), the second
    # text still typed 1 (all 5 of the second).
    for keep, side in ((12, None), (5, "left")):
        body = {"model": "cross", "queries": QUERY, "documents": DOCS[:2],
                "truncate_prompt_tokens": keep, "truncation_side": side}  # fmt: skip
        short = post(cross, "/score", body).json()
        kept = cross_logits(folders["cross"], pairs[:2], keep=keep, last=side == "left")
        np.testing.assert_allclose([r["score"] for r in short["data"]], 1 / (1 + np.exp(-kept)),
                                   atol=2e-5)  # fmt: skip
    alone = post(cross, "/classify", {"model": "cross", "input": [QUERY, DOCS[1]]})
    expected = 1 / (1 + np.exp(-cross_logits(folders["cross"], [(QUERY,), (DOCS[1],)])))
    got = [row["probs"][0] for row in alone.json()["data"]]
    np.testing.assert_allclose(got, expected, atol=2e-5)


def test_a_modernbert_reranker_scores_as_transformers(folders: dict[str, Path]) -> None:
    """gte-reranker-modernbert's kind: each pair read as [CLS] query [SEP] document [SEP]
    (no token types), mean-pooled through local layers narrower than the longer pairs."""
    import torch

    model, tokenizer = hf(folders["modern"], "AutoModelForSequenceClassification")
    with torch.no_grad():
        logits = np.array([float(model(**tokenizer(QUERY, doc, return_tensors="pt")).logits[0, 0])
                           for doc in DOCS])  # fmt: skip
    with contextlib.contextmanager(served)(folders["modern"], "modern") as server:
        reranked_as(server, "modern", 1 / (1 + np.exp(-logits)))
