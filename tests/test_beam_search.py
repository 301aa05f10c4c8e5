"""vLLM's beam search (`use_beam_search`) through the official client on a float32 stack: the
choices are the beams vLLM's algorithm finds on transformers' logprobs of the same weights, in
its order, EOS-ended ones included, streamed or not; what a beam search cannot honour is refused
by name; the KV cache is whole afterwards."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from conftest import MODEL
from test_failures import wait_until_whole

from turnstile.bench.server_process import Server, launched_server
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # starts a stack and loads transformers


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with launched_server("--dtype", "float32", "--num-blocks", "256") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def model() -> Any:
    from turnstile.bench import hf_baseline

    return hf_baseline.load_model(embedded_model_path(), torch.float32)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    path = embedded_model_path()
    return Tokenizer(path, read_model_info(path))


@functools.cache
def _top(model: Any, ids: tuple[int, ...], k: int) -> list[tuple[float, int]]:
    """The k best next tokens after `ids` and their logprobs; kept, as the beams of every
    length penalty grow alike (it ranks them only at the end)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    top = logits.float().log_softmax(-1).topk(k)
    return list(zip(top.values.tolist(), top.indices.tolist(), strict=True))


def vllm_beams(
    model: Any, prompt: list[int], width: int, steps: int, eos: set[int], penalty: float
) -> list[tuple[list[int], str]]:
    """vLLM's algorithm (vllm/entrypoints/generate/beam_search/online.py) on transformers'
    logprobs: each beam's top 2 x width next tokens; an EOS sets a beam aside; the width best
    by summed logprob go on; then all ranked by sum / (prompt + tokens, an EOS not) ** penalty.
    Each beam's tokens (its EOS dropped) and finish reason."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(steps):
        candidates = []
        for tokens, total in live:
            for logprob, token in _top(model, (*prompt, *tokens), 2 * width):
                (done if token in eos else candidates).append(([*tokens, token], total + logprob))
        live = sorted(candidates, key=lambda beam: -beam[1])[:width]

    def score(beam: tuple[list[int], float]) -> float:
        length = len(prompt) + len(beam[0]) - (beam[0][-1] in eos)
        return beam[1] / max(length, 1) ** penalty

    best = sorted(done + live, key=score, reverse=True)[:width]
    return [(t[:-1], "stop") if t[-1] in eos else (t, "length") for t, _ in best]


@pytest.mark.parametrize("penalty", [1.0, 0.0, 2.0])
def test_the_choices_are_vllms_beams(
    client: openai.OpenAI, model: Any, tokenizer: Tokenizer, penalty: float
) -> None:
    """Two prompts at once, three beams each: token for token, in vLLM's order."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    answer = client.completions.create(
        model=MODEL, prompt=prompts, n=3, max_tokens=8, temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": penalty, "return_token_ids": True},
    )  # fmt: skip
    eos = set(tokenizer.info.all_eos_token_ids)
    for p, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt, add_special_tokens=True)  # as completions encode
        expected = vllm_beams(model, ids, 3, 8, eos, penalty)
        choices = sorted(answer.choices, key=lambda c: c.index)[3 * p : 3 * p + 3]
        got = [(c.model_extra["token_ids"], c.finish_reason) for c in choices]
        assert got == expected
        assert [c.text for c in choices] == [tokenizer.decode(t) for t, _ in expected]
        assert len({tuple(t) for t, _ in got}) == 3  # three different beams
    assert answer.usage.completion_tokens == sum(
        len(c.model_extra["token_ids"]) for c in answer.choices
    )


def test_a_chats_beams_end_at_eos_as_vllms(
    client: openai.OpenAI, model: Any, tokenizer: Tokenizer, server: Server
) -> None:
    """Beams that end in the chat's end token are set aside and ranked with the live ones;
    streamed, the same beams."""
    messages = [{"role": "user", "content": "What is 2 + 2? Answer with a number."}]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_tokens=12,
        extra_body={"use_beam_search": True, "return_token_ids": True},
    )  # fmt: skip
    eos = set(tokenizer.info.all_eos_token_ids)
    ids = tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=True))
    expected = vllm_beams(model, ids, 2, 12, eos, 1.0)
    assert [reason for _, reason in expected].count("stop") >= 1  # an EOS ended one
    got = [(c.model_extra["token_ids"], c.finish_reason) for c in answer.choices]
    assert got == expected
    assert [c.message.content for c in answer.choices] == [tokenizer.decode(t) for t, _ in expected]
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"use_beam_search": True},
    )  # fmt: skip
    texts, reasons, usage = ["", ""], [None, None], None
    for chunk in streamed:  # each beam's text comes whole as the search ends, as vLLM's
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.message.content for c in answer.choices]
    assert reasons == [c.finish_reason for c in answer.choices]
    assert usage.completion_tokens == answer.usage.completion_tokens
    wait_until_whole(server)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
        ({"use_beam_search": True, "min_tokens": 2}, "min_tokens"),
        ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
        ({"use_beam_search": True, "stop": ["."]}, "stop"),
        ({"use_beam_search": True, "seed": 1}, "seed"),
        ({"use_beam_search": True, "n": 11}, "n"),
        ({"length_penalty": 0.5}, "length_penalty"),
    ],
)
def test_what_a_beam_search_cannot_honour_is_refused_by_name(
    client: openai.OpenAI, fields: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=fields)
    assert refused.value.body["param"] == param
