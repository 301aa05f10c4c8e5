"""The OpenAI-compatible API end to end: real processes over ZeroMQ on loopback, the official
openai client, real HTTP."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest
from conftest import MODEL

from turnstile.bench.server_process import Server

pytestmark = pytest.mark.slow  # starts a stack or loads models

# The first has a wide margin for its first token (0.55 against 0.13): a near tie would let any
# weight format flip it.
QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three colors.",
    "Say hello in Spanish.",
]


def test_models_and_health(service: Server, client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list().data] == [MODEL]
    for probe in ("health", "ping"):  # /ping: SageMaker's, as vLLM's
        with urllib.request.urlopen(f"{service.url}/{probe}") as answer:
            assert answer.status == 200
    posted = urllib.request.Request(f"{service.url}/ping", method="POST")  # vLLM answers both
    with urllib.request.urlopen(posted) as answer:
        assert answer.status == 200


def test_a_page_from_any_origin_may_call_the_api_by_default(service: Server) -> None:
    """vLLM's default --allowed-origins '["*"]': a browser's preflight from anywhere is
    answered, and a streamed answer names the page's origin."""
    url = f"{service.url}/v1/chat/completions"
    origin = {"Origin": "http://localhost:3000"}
    preflight = urllib.request.Request(url, method="OPTIONS", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})  # fmt: skip
    with urllib.request.urlopen(preflight) as answer:
        assert answer.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert "POST" in answer.headers["Access-Control-Allow-Methods"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "stream": True}  # fmt: skip
    streamed = urllib.request.Request(url, json.dumps(body).encode(), method="POST", headers={
        **origin, "Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(streamed) as answer:
        assert answer.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert answer.read().decode().rstrip().endswith("data: [DONE]")


def test_chat_streamed_equals_whole_and_usage_is_right(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0
    )
    text = whole.choices[0].message.content
    assert "Paris" in text
    assert whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=40, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert usage is not None
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(usage, n) for n in counts] == [getattr(whole.usage, n) for n in counts]
    assert usage.prompt_tokens_details.cached_tokens == 32  # the first asking's full blocks
    assert usage.completion_tokens <= 40 and usage.prompt_tokens > 20
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_streamed_equals_whole_with_stop_string(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, prompt="Count: one, two, three,", max_tokens=30, temperature=0)
    whole = client.completions.create(**args)
    text = whole.choices[0].text
    assert whole.usage.completion_tokens == 30 and whole.choices[0].finish_reason == "length"
    stop = text[8:11]
    cut = client.completions.create(**args, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**args, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_logprobs_and_seeded_sampling(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0.9, seed=42)
    first = client.completions.create(**args, logprobs=3)
    again = client.completions.create(**args, logprobs=3)
    assert first.choices[0].text == again.choices[0].text
    logprobs = first.choices[0].logprobs
    assert len(logprobs.tokens) == 5 == len(logprobs.token_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    # Greedy: the chosen token is the most likely one.
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) for entry in content)


def test_32_concurrent_streams_all_finish(service: Server) -> None:
    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str]:
        body = {
            "model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 16 + i % 5,
            "temperature": 0, "ignore_eos": True, "stream": True,
        }  # fmt: skip
        pieces, done = [], False
        async with session.post(f"{service.url}/v1/completions", json=body) as response:
            assert response.status == 200
            async for line in response.content:
                data = line.decode().strip().removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                elif data:
                    pieces.append(json.loads(data)["choices"][0]["text"])
        assert done
        return i, "".join(pieces)

    async def all_of_them() -> list[tuple[int, str]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    assert sorted(i for i, _ in results) == list(range(32))
    assert all(text for _, text in results)


def test_greedy_over_http_equals_turnstile_generate(client: openai.OpenAI, tmp_path: Path) -> None:
    lines = [{"messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0}
             for q in QUESTIONS]  # fmt: skip
    lines[0]["response_format"] = {"type": "json_object"}  # held to as served
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    subprocess.run(
        [sys.executable, "-m", "turnstile.cli", "generate", "--input", str(source),
         "--output", str(target)],
        check=True, timeout=300,
    )  # fmt: skip
    offline = [json.loads(line) for line in target.read_text().splitlines()]
    for line, result in zip(lines, offline, strict=True):
        answer = client.chat.completions.create(model=MODEL, **line)
        assert answer.choices[0].message.content == result["text"]
        assert answer.usage.completion_tokens == len(result["token_ids"])
        assert answer.choices[0].finish_reason == result["finish_reason"]


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b'{"prompt": 5}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "temperature": 7}', 400, "temperature"),
        ("/v1/completions", b'{"prompt": "x", "n": 200}', 400, "$.n"),
        ("/v1/completions", b'{"prompt": [1, 99999999]}', 400, "token ids"),
        ("/v1/completions", b'{"prompt": "x", "model": "gpt-9"}', 404, "does not exist"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 9000}', 400, "maximum context"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/completions", b'{"prompt": "\xff\xfe caf\xe9"}', 400, "not valid JSON"),
        (
            "/v1/completions",
            b'{"prompt": "x", "x": ' + b"[" * 999 + b"]" * 999 + b"}",
            400,
            "request",
        ),
        ("/v1/completions", b'{"prompt": "' + b"ab " * 1_200_000 + b'"}', 400, "characters"),
        ("/v1/nothing", b"{}", 404, "Not Found"),
    ],
)
def test_bad_requests_get_openai_errors(
    service: Server, path: str, body: bytes, status: int, words: str
) -> None:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{service.url}{path}", data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as failure:
        urllib.request.urlopen(request, timeout=10)
    assert failure.value.code == status
    error = json.loads(failure.value.read())["error"]
    assert words in error["message"] and error["type"] and error["code"]


def test_a_disconnected_stream_frees_its_kv_blocks(service: Server) -> None:
    async def read_a_little_then_leave() -> None:
        body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000,
                "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{service.url}/v1/completions", json=body) as response,
        ):
            for _ in range(5):
                await response.content.readline()

    aborts = 'turnstile:request_success_total{finished_reason="abort"}'
    before = service.scrape().get(aborts, 0)
    asyncio.run(read_a_little_then_leave())
    deadline = time.monotonic() + 15
    while True:  # the abort counted first: the gauges may still be from before the request
        series = service.scrape()
        free, total = (
            series["turnstile:kv_cache_free_blocks"],
            series["turnstile:kv_cache_total_blocks"],
        )
        aborted = series.get(aborts, 0) > before
        if aborted and series["turnstile:num_requests_running"] == 0 and free == total:
            break
        assert time.monotonic() < deadline, f"aborted: {aborted}; {free} of {total} blocks free"
        time.sleep(0.2)
