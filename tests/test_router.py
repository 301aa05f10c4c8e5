"""Replicas behind sglang-router, SGLang's model gateway: the real router in its own process
routes the official openai client's requests over two `turnstile serve` stacks. The router
rewrites each request with SGLang's own fields, so this is also where those are proven
accepted."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from conftest import MODEL, logged_stack

from turnstile.bench.server_process import Server, free_ports

pytestmark = pytest.mark.slow  # starts a second stack and the router

WORDS = ("river", "stone", "cloud", "lantern", "meadow", "copper", "violet", "harbor")


def served_requests(server: Server) -> float:
    """The requests a replica's gateway has answered."""
    series = server.scrape(int(server.url.rsplit(":", 1)[1]))  # the gateway's /metrics
    return sum(v for name, v in series.items() if name.startswith("turnstile:http_requests_total{"))


@pytest.fixture(scope="module")
def replica(stack_log: Path) -> Iterator[Server]:
    """On one thread: two stacks' teams of threads on the same two cores wait on each other at
    every barrier (six requests took 20 s, not 1.5; README, "Replicas behind sglang-router")."""
    flags = ("--num-blocks", "256", "--max-num-seqs", "32", "--disable-log-stats",
             "--log-stats-interval", "0.5")  # fmt: skip
    with logged_stack(stack_log, *flags, env={"OMP_NUM_THREADS": "1"}) as running:
        yield running


@pytest.fixture(scope="module")
def router(service: Server, replica: Server) -> Iterator[str]:
    """The router's URL, once it counts both replicas healthy. Its default policy,
    cache_aware: a prompt goes where its text's prefix went before, else to the least busy."""
    port, metrics = free_ports(2)
    process = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--prometheus-port", str(metrics), "--policy", "cache_aware",
         "--worker-urls", service.url, replica.url, "--log-level", "warn"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while sum(w["is_healthy"] for w in _workers(url)) < 2:
            assert process.poll() is None, "the router exited"
            assert time.monotonic() < deadline, "the router did not take both replicas"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)


def _workers(url: str) -> list[dict[str, object]]:
    try:
        with urllib.request.urlopen(f"{url}/workers", timeout=5) as response:
            return json.loads(response.read())["workers"]
    except OSError:
        return []


@pytest.fixture(scope="module")
def routed(router: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0)


def test_the_router_knows_the_replicas_model_by_its_served_name(router: str) -> None:
    assert [w["model_id"] for w in _workers(router)] == [MODEL, MODEL]  # from /server_info


def test_the_routers_http2_probe_is_one_line_in_the_log_not_an_error(
    router: str, stack_log: Path
) -> None:
    log = stack_log.read_text()
    assert "not be parsed was answered 400: Pause on PRI/Upgrade" in log
    assert "Traceback" not in log and " ERROR " not in log


def test_answers_through_the_router_are_the_replicas_own(
    routed: openai.OpenAI, client: openai.OpenAI
) -> None:
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                max_tokens=12, temperature=0)  # fmt: skip
    direct = client.chat.completions.create(**chat).choices[0].message.content
    assert routed.chat.completions.create(**chat).choices[0].message.content == direct
    stream = routed.chat.completions.create(
        **chat, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    prompt = dict(model=MODEL, prompt="Count: one, two,", max_tokens=8, temperature=0)
    text = client.completions.create(**prompt).choices[0].text
    assert routed.completions.create(**prompt).choices[0].text == text
    with pytest.raises(openai.BadRequestError) as refusal:  # the replica's 400, passed on
        routed.completions.create(**prompt, extra_body={"best_of": 2})
    assert refusal.value.body["param"] == "best_of"
    texts = ["a red apple", "a green leaf"]
    direct_vectors = client.embeddings.create(model=MODEL, input=texts).data
    routed_vectors = routed.embeddings.create(model=MODEL, input=texts).data
    for ours, theirs in zip(direct_vectors, routed_vectors, strict=True):
        assert ours.embedding == pytest.approx(theirs.embedding, abs=1e-5)


def test_prompts_spread_over_the_replicas_and_a_prefix_returns_to_its_own(
    routed: openai.OpenAI, service: Server, replica: Server
) -> None:
    """Six prompts at once go to the least busy replica, so to both; each sent again later
    goes where its prefix went, which finds it in that replica's prefix cache."""
    before = [served_requests(service), served_requests(replica)]
    prefixes = [f"Story {i}: " + " ".join(WORDS[(i * j) % len(WORDS)] for j in range(80))
                for i in range(6)]  # fmt: skip

    def ask(text: str) -> openai.types.chat.ChatCompletion:
        return routed.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=8,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip

    with ThreadPoolExecutor(len(prefixes)) as pool:
        list(pool.map(ask, [p + " First question." for p in prefixes]))
    served = [served_requests(service) - before[0], served_requests(replica) - before[1]]
    assert sum(served) == len(prefixes) and min(served) > 0, served
    for prefix in reversed(prefixes):  # not the order a round robin would repeat
        again = ask(prefix + " Second question.").usage
        assert again is not None and again.prompt_tokens_details is not None
        # Elsewhere only the chat template's first block would be found.
        assert again.prompt_tokens_details.cached_tokens >= 80, again


def test_a_replica_under_disable_log_stats_writes_no_stats_line(stack_log: Path) -> None:
    """After the requests it served above, and two of its intervals more."""
    time.sleep(1.0)
    assert "Avg prompt throughput" not in stack_log.read_text()
