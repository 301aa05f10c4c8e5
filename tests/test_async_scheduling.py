"""Async scheduling (the next step planned while the executor runs this one) changes no
answer: greedy and seeded outputs through the real processes are the same with and without it,
for a batch that ends by EOS, stop token ids, stop strings and max_tokens, with an abort beside
it and a KV cache small enough to preempt."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from conftest import MODEL

from turnstile.bench.server_process import launched_server

pytestmark = pytest.mark.slow  # two stacks

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Say hello in Spanish."]
COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": "The history of the printing press", "max_tokens": 40},  # length
    # Long answers at once: more KV than the cache holds.
    {"prompt": "Rivers of Europe:", "max_tokens": 100, "extra_body": {"ignore_eos": True}},
    {"prompt": "Famous painters:", "max_tokens": 100, "extra_body": {"ignore_eos": True}},
    {
        "prompt": "Birds of the Alps:",
        "max_tokens": 90,
        "temperature": 0.9,
        "seed": 5,
        "extra_body": {"ignore_eos": True},
    },
    {"prompt": "A list of fruits: apple,", "max_tokens": 60, "stop": [" banana", "\n\n"]},
    {"prompt": "Count: one, two,", "max_tokens": 60, "extra_body": {"stop_token_ids": [28]}},
    {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0.8, "seed": 7},
    {"prompt": "The ocean is", "max_tokens": 48, "temperature": 1.0, "top_p": 0.9, "seed": 3},
]


async def answers(url: str) -> list[tuple[str, str, int]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    async def chat(question: str, seed: int | None) -> tuple[str, str, int]:
        answer = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            max_tokens=120,
            temperature=0.0 if seed is None else 0.7,
            seed=seed,
        )
        choice = answer.choices[0]
        return choice.message.content or "", choice.finish_reason, answer.usage.completion_tokens

    async def complete(fields: dict[str, Any]) -> tuple[str, str, int]:
        answer = await client.completions.create(model=MODEL, **{"temperature": 0.0, **fields})
        choice = answer.choices[0]
        return choice.text, choice.finish_reason, answer.usage.completion_tokens

    async def abandoned() -> None:
        stream = await client.completions.create(
            model=MODEL, prompt="Tell me a long story", max_tokens=100, stream=True
        )
        async for _ in stream:
            break
        await stream.close()  # the gateway aborts it; its blocks go back mid-batch

    jobs = [chat(q, None) for q in QUESTIONS] + [chat(q, 11) for q in QUESTIONS]
    jobs += [complete(fields) for fields in COMPLETIONS]
    results = await asyncio.gather(abandoned(), *jobs)
    await client.close()
    return results[1:]


def served(*flags: str) -> tuple[list[tuple[str, str, int]], float]:
    # 16 blocks of 16 tokens for 14 requests at once: preemption is certain.
    with launched_server("--num-blocks", "16", "--max-num-seqs", "12", *flags) as server:
        results = asyncio.run(answers(server.url))
        return results, server.scrape()["turnstile:num_preemptions_total"]


def test_async_scheduling_answers_as_lockstep_does() -> None:
    lockstep, lockstep_preemptions = served("--no-async-scheduling")
    ahead, ahead_preemptions = served()
    assert lockstep_preemptions > 0 and ahead_preemptions > 0
    reasons = {reason for _, reason, _ in lockstep}
    assert reasons == {"stop", "length"}, reasons  # EOS, stop ids and strings; max_tokens
    assert ahead == lockstep
