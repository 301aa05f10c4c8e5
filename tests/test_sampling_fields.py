"""vLLM's sampling fields through the running service with the official openai client: each
changes the output as its definition says, and a seed picks the same tokens alone or batched."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from conftest import MODEL

from turnstile.bench.server_process import Server

pytestmark = pytest.mark.slow  # starts a stack

REPEATING = "I like apples. I like apples. I like apples."  # greedy goes on repeating itself


def complete(client: openai.OpenAI, prompt: str = REPEATING, **fields: object) -> str:
    answer = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, extra_body=fields
    )
    return answer.choices[0].text


def token_ids(service: Server, text: str) -> list[int]:
    root = openai.OpenAI(base_url=service.url, api_key="unused", max_retries=0)
    return root.post("/tokenize", cast_to=object, body={"prompt": text})["tokens"]


def test_penalties_stop_a_repetition_greedy_produces(client: openai.OpenAI) -> None:
    greedy = complete(client)
    assert greedy.count("big apple") >= 3
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                    {"repetition_penalty": 1.5}):  # fmt: skip
        assert complete(client, **penalty).count("big apple") <= 1, penalty
    assert complete(client, frequency_penalty=-2.0).count("big apple") >= 3  # < 0 encourages


def test_a_bias_of_minus_100_removes_the_greedy_token(
    service: Server, client: openai.OpenAI
) -> None:
    greedy = complete(client, max_tokens=1)
    [first] = token_ids(service, greedy)
    other = complete(client, logit_bias={str(first): -100})
    assert not other.startswith(greedy)
    assert complete(client, logit_bias={str(first): 100}).startswith(greedy * 3)


def test_allowed_token_ids_and_bad_words(service: Server, client: openai.OpenAI) -> None:
    allowed = token_ids(service, " yes") + token_ids(service, " no")
    text = complete(client, allowed_token_ids=allowed)
    assert re.fullmatch(r"( yes| no)+", text), text
    assert "apple" in complete(client)
    banned = complete(client, bad_words=["apple", "apples"])
    assert "apple" not in banned and banned


def test_min_tokens_holds_back_the_end(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    natural = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert natural.choices[0].finish_reason == "stop"
    ends = natural.usage.completion_tokens
    held = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=ends + 30,
        extra_body={"min_tokens": ends + 10},
    )  # fmt: skip
    assert held.usage.completion_tokens >= ends + 10


def test_a_seed_with_penalties_gives_the_same_text_alone_or_batched(
    client: openai.OpenAI,
) -> None:
    fields = dict(model=MODEL, prompt=REPEATING, max_tokens=24, temperature=0.9, seed=21)
    extra = {"frequency_penalty": 0.8, "min_p": 0.05, "logit_bias": {"13": 3}}
    alone = client.completions.create(**fields, extra_body=extra).choices[0].text

    def other(i: int) -> str:
        body = {"presence_penalty": 1.0, "bad_words": ["the"]} if i % 2 else {}
        answer = client.completions.create(
            model=MODEL, prompt=f"Story {i}:", max_tokens=30, temperature=1.0, extra_body=body
        )
        return answer.choices[0].text

    with ThreadPoolExecutor(6) as pool:
        crowd = [pool.submit(other, i) for i in range(5)]
        batched = client.completions.create(**fields, extra_body=extra).choices[0].text
        assert all(isinstance(f.result(), str) for f in crowd)
    assert batched == alone


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"allowed_token_ids": [10**8]}, "allowed_token_ids"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ],
)
def test_values_out_of_range_are_refused_by_name(
    client: openai.OpenAI, fields: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refusal:
        complete(client, **fields)
    assert param in (refusal.value.body["param"] or "")
