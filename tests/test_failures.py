"""Faults injected into a live stack: kill -9 an executor, then the scheduler, while streamed
requests are in flight. Nothing may hang; every request completes correctly or gets a clear
error; afterwards the service answers and the KV accounting is whole."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator

import aiohttp
import psutil
import pytest
from conftest import MODEL

from bench.server_process import Server, healthy, launched_server

PROMPTS = [f"Write a list of {n} fruits and their colors:" for n in range(3, 9)]


@pytest.fixture
def server() -> Iterator[Server]:
    with launched_server("--num-blocks", "256", "--max-num-seqs", "8") as running:
        yield running


def kill_child(server: Server, service: str) -> None:
    for child in psutil.Process(server.process.pid).children():
        if service in child.cmdline():
            os.kill(child.pid, signal.SIGKILL)
            return
    raise AssertionError(f"no {service} process")


async def stream(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[str, list]:
    """The streamed text and any error events; (text, [status]) if refused outright."""
    # Long enough to be under way when the fault comes 1.5 s in, however fast a step is.
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 256, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            return "", [response.status]
        text, errors = [], []
        async for raw in response.content:
            line = raw.decode().strip().removeprefix("data: ")
            if not line or line == "[DONE]":
                continue
            event = json.loads(line)
            if "error" in event:
                errors.append(event["error"])
            else:
                text.append(event["choices"][0]["text"])
        return "".join(text), errors


async def run_with_fault(url: str, kill: Callable[[], None] | None) -> list:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [asyncio.create_task(stream(session, url, p)) for p in PROMPTS]
        if kill is not None:
            await asyncio.sleep(1.5)  # the streams are under way
            kill()
        return await asyncio.gather(*tasks)


def wait_until_whole(server: Server, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        if healthy(server.url):
            series = server.scrape()
            free = series.get("turnstile:kv_cache_free_blocks")
            whole = free is not None and free == series["turnstile:kv_cache_total_blocks"]
            if whole and series["turnstile:num_requests_running"] == 0:
                return
        assert time.monotonic() < deadline, "the service did not recover"
        time.sleep(0.3)


def test_executor_killed_mid_stream_every_request_still_finishes_correctly(
    server: Server,
) -> None:
    undisturbed = asyncio.run(run_with_fault(server.url, None))
    assert all(text and not errors for text, errors in undisturbed)
    started = time.monotonic()
    disturbed = asyncio.run(run_with_fault(server.url, lambda: kill_child(server, "executor")))
    # The dead executor was restarted and the requests recomputed from their tokens.
    assert time.monotonic() - started < 90
    assert disturbed == undisturbed
    wait_until_whole(server)
    series = server.scrape()
    assert series["turnstile:num_preemptions_total"] >= 1


def test_scheduler_killed_mid_stream_requests_fail_cleanly_then_service_recovers(
    server: Server,
) -> None:
    started = time.monotonic()
    results = asyncio.run(run_with_fault(server.url, lambda: kill_child(server, "scheduler")))
    assert time.monotonic() - started < 30, "a request hung"
    for text, errors in results:
        # Each either finished (before the kill) or ended with a clear error.
        assert errors or len(text) > 0
        for error in errors:
            assert error in (503,) or "scheduler" in error["message"]
    assert any(errors for _, errors in results)
    wait_until_whole(server)
    answer = asyncio.run(run_with_fault(server.url, None))
    assert all(text and not errors for text, errors in answer)


def test_sigterm_drains_requests_under_way_before_stopping() -> None:
    with launched_server("--num-blocks", "128") as server:

        async def stream_then_stop() -> tuple[str, list]:
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                task = asyncio.create_task(stream(session, server.url, PROMPTS[0]))
                await asyncio.sleep(1.0)
                server.process.send_signal(signal.SIGTERM)
                return await task

        text, errors = asyncio.run(stream_then_stop())
        assert server.process.wait(timeout=60) == 0
    assert not errors and len(text) > 20  # all 48 tokens arrived despite the SIGTERM
