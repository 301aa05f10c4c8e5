"""`/v1/embeddings` through a real stack and the official openai client. On a tiny random Qwen3
written as Qwen3-Embedding is (sentence-transformers' last-token Pooling and Normalize modules,
Matryoshka dimensions, a tokenizer that closes each text with its EOS): every vector against
transformers' `AutoModel` (the last token's final hidden state, normalized), inputs batched,
chunked and found in the prefix cache alike. On the embedded model: what is refused, by name."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

from turnstile.bench import random_llama
from turnstile.bench.server_process import Server, launched_server
from turnstile.shared.pooling import gguf_pooling, hf_pooling

pytestmark = pytest.mark.slow  # starts a stack

TEXTS = ["w5 w6 w7", " ".join(f"w{i}" for i in range(10, 110)), "w40"]  # the second: chunked
MODULES = random_llama.EMBEDDER_MODULES
# Each message after w3, a generation prompt of w4.
TEMPLATE = "{% for m in messages %}w3 {{ m.content }} {% endfor %}"
TEMPLATE += "{% if add_generation_prompt %}w4{% endif %}"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_llama.embedder(tmp_path_factory.mktemp("embedder"))


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[Server]:
    with launched_server(
        "--model", str(model), "--dtype", "float32", "--served-model-name", "embedder",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--max-model-len", "112",
        "--chat-template", TEMPLATE,
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def embedder(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def reference(model: Path, ids: list[list[int]], width: int = 128) -> np.ndarray:
    """transformers' last hidden state of each input's last token, cut and normalized."""
    import torch
    import transformers

    hf = transformers.AutoModel.from_pretrained(model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [hf(torch.tensor([row])).last_hidden_state[0, -1, :width] for row in ids]
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy()


def token_ids(model: Path, text: str) -> list[int]:
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids


def vectors(answer: openai.types.CreateEmbeddingResponse) -> np.ndarray:
    assert [item.index for item in answer.data] == list(range(len(answer.data)))
    return np.array([item.embedding for item in answer.data])


def test_each_input_embeds_as_transformers_does(model: Path, embedder: openai.OpenAI) -> None:
    ids = [token_ids(model, text) for text in TEXTS]
    assert ids[0][-1] == 2 and len(ids[1]) > 32  # closed by EOS; more than one step's tokens
    expected = reference(model, [*ids, [7, 8, 9]])
    answer = embedder.embeddings.create(model="embedder", input=TEXTS)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    np.testing.assert_allclose(vectors(answer), expected[:3], atol=2e-5)
    by_ids = embedder.embeddings.create(model="embedder", input=[[7, 8, 9]])
    np.testing.assert_allclose(vectors(by_ids)[0], expected[3], atol=2e-5)
    whole = [7 + i % 40 for i in range(112)]  # the context, all 7 blocks of 16: as vLLM allows
    filled = embedder.embeddings.create(model="embedder", input=[whole])
    np.testing.assert_allclose(vectors(filled)[0], reference(model, [whole])[0], atol=2e-5)
    again = embedder.embeddings.create(model="embedder", input=TEXTS[1])  # its blocks cached
    np.testing.assert_allclose(vectors(again)[0], expected[1], atol=2e-5)
    raw = embedder.embeddings.create(  # vLLM's use_activation false: not normalized
        model="embedder", input=TEXTS[2], extra_body={"use_activation": False}
    )
    found = vectors(raw)[0]
    assert abs(np.linalg.norm(found) - 1) > 0.1
    np.testing.assert_allclose(found / np.linalg.norm(found), expected[2], atol=2e-5)


def test_a_conversation_is_embedded_without_the_tokenizers_special_tokens(
    model: Path, embedder: openai.OpenAI
) -> None:
    """As vLLM: the chat template writes a conversation's special tokens; the tokenizer's own
    (this one's closing EOS) only with add_special_tokens."""
    chat = [{"role": "user", "content": "w5 w6"}, {"role": "user", "content": "w7"}]
    expected = reference(model, [[3, 5, 6, 3, 7], [3, 5, 6, 3, 7, 2]])
    for special, vector in ((None, expected[0]), (False, expected[0]), (True, expected[1])):
        body = {"messages": chat} | ({} if special is None else {"add_special_tokens": special})
        answer = requests.post(f"{embedder.base_url}embeddings", json=body, timeout=60).json()
        np.testing.assert_allclose(answer["data"][0]["embedding"], vector, atol=2e-5)


def test_scores_are_the_embeddings_cosines(model: Path, server: Server) -> None:
    """A bi-encoder's /score and /rerank, as vLLM's for an embedding model: each text embedded
    alone (the query once), a pair scored by its vectors' cosine; no /classify."""
    expected = reference(model, [token_ids(model, text) for text in TEXTS])
    cosines = expected[1:] @ expected[0]
    body = {"model": "embedder", "text_1": TEXTS[0], "text_2": TEXTS[1:]}
    score = requests.post(f"{server.url}/score", json=body, timeout=60).json()
    np.testing.assert_allclose([item["score"] for item in score["data"]], cosines, atol=2e-5)
    tokens = sum(len(token_ids(model, text)) for text in TEXTS)
    assert score["usage"]["prompt_tokens"] == tokens
    body = {"model": "embedder", "query": TEXTS[0], "documents": TEXTS[1:]}
    rerank = requests.post(f"{server.url}/v1/rerank", json=body, timeout=60).json()
    assert [result["index"] for result in rerank["results"]] == list(np.argsort(-cosines))
    refused = requests.post(f"{server.url}/classify", json={"input": "w5"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def test_matryoshka_dimensions_and_base64(model: Path, embedder: openai.OpenAI) -> None:
    expected = reference(model, [token_ids(model, TEXTS[0])], width=32)[0]
    cut = embedder.embeddings.create(model="embedder", input=TEXTS[0], dimensions=32)
    np.testing.assert_allclose(vectors(cut)[0], expected, atol=2e-5)
    raw = requests.post(
        f"{embedder.base_url}embeddings",
        json={"input": TEXTS[0], "dimensions": 32, "encoding_format": "base64"},
    ).json()
    packed = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(packed, expected, atol=2e-5)
    with pytest.raises(openai.BadRequestError) as refused:
        embedder.embeddings.create(model="embedder", input=TEXTS[0], dimensions=40)
    assert refused.value.body["param"] == "dimensions" and "[32, 64, 128]" in refused.value.message


def test_no_token_of_an_embedding_counts_as_generated(
    server: Server, embedder: openai.OpenAI
) -> None:
    """The scheduler's generation counter takes a completion's 3 tokens, none of the inputs'
    sampled and dropped (embedded before and after it)."""
    embedder.embeddings.create(model="embedder", input=TEXTS)
    embedder.completions.create(model="embedder", prompt="w5", max_tokens=3,
                                extra_body={"ignore_eos": True})  # fmt: skip
    embedder.embeddings.create(model="embedder", input=TEXTS)
    counted = 0.0
    for _ in range(50):  # the counter is published a moment after the step
        counted = server.scrape().get("turnstile:generation_tokens_total", 0.0)
        if counted >= 3:
            break
        time.sleep(0.1)
    assert counted == 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
        ({"input": "hi", "pooling": "mean"}, "pooling"),  # a field no one declares
        ({"input": ["hi", [5, 6]]}, "input"),  # texts and ids mixed
        ({"input": ""}, "input"),  # no token
        ({"input": [[5, 49152]]}, "input"),  # outside the vocabulary
        ({"input": [[5] * 8193]}, "input"),  # past the context
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_what_is_refused_is_named(service: Server, body: dict, param: str) -> None:
    answer = requests.post(f"{service.url}/v1/embeddings", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_the_embedded_model_embeds_its_tokens(service: Server, client: openai.OpenAI) -> None:
    """Last-token pooling of a generative model, as vLLM's `--convert embed`: unit vectors, one
    per input, the same for the same text however it is batched."""
    answer = client.embeddings.create(model="SmolLM2-135M-Instruct", input=["a cat", "a dog"])
    alone = client.embeddings.create(model="SmolLM2-135M-Instruct", input="a dog")
    found = vectors(answer)
    assert found.shape == (2, 576)
    np.testing.assert_allclose(np.linalg.norm(found, axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(vectors(alone)[0], found[1], atol=1e-4)
    counted = [
        requests.post(f"{service.url}/tokenize", json={"prompt": text}).json()["count"]
        for text in ("a cat", "a dog")
    ]
    assert answer.usage.prompt_tokens == sum(counted)


def test_a_conversation_embeds_as_its_chat_template_writes_it(service: Server) -> None:
    """vLLM's chat embeddings: `messages` (a conversation, or a list of them) rendered by the
    chat template, no generation prompt unless asked, the template's own special tokens only;
    each vector that of the rendered prompt's token ids."""
    url, model = f"{service.url}/v1/embeddings", "SmolLM2-135M-Instruct"
    chats = [
        [{"role": "user", "content": "a cat"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a dog"}],
    ]

    def ids(chat: list[dict], **options: bool) -> list[int]:
        body = {"messages": chat, "add_generation_prompt": False, **options}
        return requests.post(f"{service.url}/tokenize", json=body, timeout=30).json()["tokens"]

    def embedded(**body: object) -> dict:
        answer = requests.post(url, json={"model": model, **body}, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()

    by_ids = embedded(input=[ids(chat) for chat in chats])
    expected = np.array([item["embedding"] for item in by_ids["data"]])
    both = embedded(messages=chats)
    assert both["usage"]["prompt_tokens"] == by_ids["usage"]["prompt_tokens"]
    np.testing.assert_allclose([item["embedding"] for item in both["data"]], expected, atol=1e-4)
    one = embedded(messages=chats[1])  # one conversation
    np.testing.assert_allclose(one["data"][0]["embedding"], expected[1], atol=1e-4)
    asked = embedded(messages=chats[0], add_generation_prompt=True)
    assert asked["usage"]["prompt_tokens"] == len(ids(chats[0], add_generation_prompt=True))
    assert asked["usage"]["prompt_tokens"] > len(ids(chats[0]))
    for body, param in (({"input": "a cat", "messages": chats[0]}, "input"),
                        ({"messages": [chats[0][0], chats[1]]}, "messages"),
                        ({"messages": chats[0], "add_generation_prompt": True,
                          "continue_final_message": True}, "continue_final_message")):  # fmt: skip
        refused = requests.post(url, json=body, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param


def test_pooling_read_from_the_model(tmp_path: Path) -> None:
    """What the gateway refuses to embed: another pooling, a module after it (Dense)."""
    mean = {"pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True}
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(mean))
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    (tmp_path / "modules.json").write_text(json.dumps([*MODULES[:2], dense]))
    fields = hf_pooling(tmp_path, {"is_matryoshka": True})
    assert fields == {"pooling": "mean then Dense", "normalize_embeddings": False,
                      "is_matryoshka": True, "matryoshka_dimensions": ()}  # fmt: skip
    metadata = {"qwen3.pooling_type": 3}
    assert gguf_pooling("qwen3", metadata.get) == {"pooling": "last"}
    assert gguf_pooling("llama", metadata.get) == {}  # a generative file: the default
