"""A bounded soak: 800 streamed requests, a tenth of them abandoned by their clients
mid-answer, on a KV cache its first few requests outgrow, so preemption is certain. Every
request must be accounted for, and every block free at the end."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest
from conftest import MODEL

from turnstile.bench.server_process import launched_server

pytestmark = pytest.mark.slow  # starts a stack or loads models

REQUESTS = 800
CONCURRENCY = 48
# The first requests, started together, outgrow the cache together (4 x 17 blocks > 40):
# short requests alone may never fill it, however many are under way.
LONG, LONG_TOKENS = 4, 60


async def one(session: aiohttp.ClientSession, url: str, i: int, leave: bool) -> str:
    max_tokens = LONG_TOKENS if i < LONG else 2 + i % 4
    body = {"model": MODEL, "prompt": f"Item {i}: the", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.7, "seed": i, "stream": True}  # fmt: skip
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            return f"http {response.status}"
        async for raw in response.content:
            line = raw.decode().strip()
            if leave and line.startswith("data: {"):
                return "left"  # closing the response mid-stream disconnects
            if line == "data: [DONE]":
                return "done"
            if '"error"' in line:
                return "error " + json.loads(line[6:])["error"]["message"]
    return "cut"


async def soak(url: str) -> list[str]:
    rng = random.Random(5)
    leaving = [i >= LONG and rng.random() < 0.1 for i in range(REQUESTS)]
    limit = asyncio.Semaphore(CONCURRENCY)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def guarded(i: int) -> str:
            async with limit:
                return await one(session, url, i, leaving[i])

        return await asyncio.gather(*(guarded(i) for i in range(REQUESTS)))


def test_soak_accounts_for_every_request_and_frees_every_block() -> None:
    flags = ("--block-size", "4", "--num-blocks", "40", "--max-num-seqs", "48",
             "--max-num-batched-tokens", "256")  # fmt: skip
    with launched_server(*flags) as server:
        outcomes = asyncio.run(soak(server.url))
        assert set(outcomes) <= {"done", "left"}, {o for o in outcomes if o not in ("done", "left")}
        assert outcomes.count("left") > REQUESTS // 20
        deadline = time.monotonic() + 30
        while True:
            series = server.scrape()
            ended = {
                name.split('"')[1]: value
                for name, value in series.items()
                if name.startswith("turnstile:request_success_total")
            }
            idle = (
                series["turnstile:num_requests_running"]
                == 0
                == series["turnstile:num_requests_waiting"]
            )
            if idle and sum(ended.values()) == REQUESTS:
                break
            assert time.monotonic() < deadline, (ended, series["turnstile:num_requests_running"])
            time.sleep(0.5)
        # Each request ended exactly once: finished or aborted by its leaving client.
        assert ended.get("length", 0) >= outcomes.count("done")
        assert ended.get("abort", 0) <= outcomes.count("left")
        assert series["turnstile:kv_cache_free_blocks"] == series["turnstile:kv_cache_total_blocks"]
        assert series["turnstile:num_preemptions_total"] > 0
