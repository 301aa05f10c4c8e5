"""End to end: real processes over ZeroMQ on loopback, the official openai client, real HTTP."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from bench.server_process import Server, healthy, launched_server

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Say hello in Spanish."]


@pytest.fixture(scope="module")
def service() -> Iterator[Server]:
    # A small KV cache (256 blocks of 16 tokens) so that load really shares it.
    with launched_server("--num-blocks", "256", "--max-num-seqs", "32") as running:
        yield running


@pytest.fixture(scope="module")
def client(service: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0)


def test_models_and_health(service: Server, client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list().data] == [MODEL]


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
    assert usage is not None and usage == whole.usage
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
        ("/v1/completions", b'{"prompt": "x", "n": 2}', 400, "$.n"),
        ("/v1/completions", b'{"prompt": [1, 99999999]}', 400, "token ids"),
        ("/v1/completions", b'{"prompt": "x", "model": "gpt-9"}', 404, "does not exist"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 9000}', 400, "maximum context"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
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

    asyncio.run(read_a_little_then_leave())
    deadline = time.monotonic() + 15
    while True:
        series = service.scrape()
        free, total = (
            series["turnstile:kv_cache_free_blocks"],
            series["turnstile:kv_cache_total_blocks"],
        )
        if series["turnstile:num_requests_running"] == 0 and free == total:
            break
        assert time.monotonic() < deadline, f"blocks still held: {free} of {total} free"
        time.sleep(0.2)
    assert series['turnstile:request_success_total{finished_reason="abort"}'] >= 1


def test_a_real_prometheus_scrapes_every_service(service: Server, tmp_path: Path) -> None:
    """Debian's prometheus (installed by `make test`) scrapes gateway, scheduler and executor;
    the series are read back through its HTTP API."""
    import shutil
    import urllib.parse
    import urllib.request

    from bench.server_process import free_ports

    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: `make test` installs Debian's package"
    (port,) = free_ports(1)
    gateway = service.url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": "gateway", "static_configs": [{"targets": [gateway]}]},
            {"job_name": "scheduler",
             "static_configs": [{"targets": [f"127.0.0.1:{service.metrics_port}"]}]},
            {"job_name": "executor",
             "static_configs": [{"targets": [f"127.0.0.1:{service.metrics_port + 1}"]}]},
        ],
    }  # fmt: skip
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    prometheus = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def query(expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(expr)}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())["data"]["result"]

    try:
        openai.OpenAI(base_url=f"{service.url}/v1", api_key="x").completions.create(
            model=MODEL, prompt="Prometheus test", max_tokens=7, temperature=0
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                up = {r["metric"]["job"]: r["value"][1] for r in query("up")}
                tokens = query("turnstile:generation_tokens_total")
                gateway_tokens = query("turnstile:gateway_generation_tokens_total")
                executor_steps = query("turnstile:executor_forward_seconds_count")
                if (
                    up == {"gateway": "1", "scheduler": "1", "executor": "1"}
                    and tokens
                    and (gateway_tokens and executor_steps)
                ):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Prometheus never saw all three services"
            time.sleep(0.5)
        # The scheduler also counts tokens generated for clients that left before reading them.
        assert float(tokens[0]["value"][1]) >= float(gateway_tokens[0]["value"][1]) >= 7
        assert float(executor_steps[0]["value"][1]) > 0
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=10)


def test_bench_client_agrees_with_the_servers_prometheus_counters(server_for_bench: Server) -> None:
    from bench import serve_bench

    before = server_for_bench.scrape()
    jobs = serve_bench.make_jobs("longtail", 12, 16, 8, seed=3)
    outcomes, duration = serve_bench.run_load(
        server_for_bench.url, MODEL, jobs, float("inf"), 8, 0, progress=False
    )
    summary = serve_bench.summarize(outcomes, duration, slo_ttft=60, slo_tpot=60)
    time.sleep(1.2)  # the scheduler refreshes its series twice a second
    after = server_for_bench.scrape()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["output_tokens"] == sum(j.output_len for j in jobs)
    assert grew("turnstile:generation_tokens_total") == summary["output_tokens"]
    assert grew("turnstile:prompt_tokens_total") == summary["prompt_tokens"]
    assert grew('turnstile:request_success_total{finished_reason="length"}') == 12
    assert summary["goodput"] == summary["request_throughput"]
    assert after["turnstile:kv_cache_free_blocks"] == after["turnstile:kv_cache_total_blocks"]


@pytest.fixture(scope="module", params=["continuous", "padded"])
def server_for_bench(request: pytest.FixtureRequest) -> Iterator[Server]:
    """A server of its own, so that no other test's traffic mixes into the counters; also
    with padded static batching, whose padding tokens must count nowhere."""
    static = [] if request.param == "continuous" else ["--static-batching", request.param]
    with launched_server("--num-blocks", "256", "--max-num-seqs", "8", *static) as running:
        yield running


def test_a_static_batch_waits_to_fill_and_opens_when_its_window_closes() -> None:
    """Requests reaching a static server a little apart still share one batch, and a batch
    that cannot fill opens once its first request has waited the fill timeout."""
    from bench import serve_bench

    static = ["--static-batching", "padded", "--static-fill-timeout", "3"]
    with launched_server("--num-blocks", "64", "--max-num-seqs", "3", *static) as server:
        before = server.scrape()["turnstile:executor_step_seconds_count"]
        # Four 6-token answers arriving about 0.25 s apart: three fill a batch, the fourth
        # waits for it to end, then for its window, and runs alone.
        jobs = serve_bench.make_jobs("random", 4, 8, 6, seed=5)
        outcomes, _ = serve_bench.run_load(server.url, MODEL, jobs, 4.0, None, 0, progress=False)
        steps = server.scrape()["turnstile:executor_step_seconds_count"] - before
    assert all(outcome.ok and outcome.output_tokens == 6 for outcome in outcomes)
    assert steps == 2 * 6  # one prefill step and five decodes per batch


@pytest.fixture(scope="module")
def guarded_server() -> Iterator[Server]:
    """One running sequence, at most one waiting, an API key."""
    with launched_server(
        "--num-blocks", "128", "--max-num-seqs", "1", "--max-waiting", "1",
        "--api-key", "sesame",
    ) as running:  # fmt: skip
        yield running


def test_api_key_is_required_on_the_api_but_not_on_probes(guarded_server: Server) -> None:
    bad = openai.OpenAI(base_url=f"{guarded_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as failure:
        bad.models.list()
    assert failure.value.body["code"] == "invalid_api_key"
    good = openai.OpenAI(base_url=f"{guarded_server.url}/v1", api_key="sesame", max_retries=0)
    assert [m.id for m in good.models.list().data] == [MODEL]
    import urllib.request

    with urllib.request.urlopen(f"{guarded_server.url}/health", timeout=5) as response:
        assert response.status == 200


def test_overload_gets_429_with_retry_after_and_no_accepted_request_is_lost(
    guarded_server: Server,
) -> None:
    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, dict, dict]:
        body = {"model": MODEL, "prompt": f"Request {i}", "max_tokens": 40, "ignore_eos": True,
                "temperature": 0}  # fmt: skip
        headers = {"Authorization": "Bearer sesame"}
        await asyncio.sleep(0.05 * i)  # arrive in order
        async with session.post(
            f"{guarded_server.url}/v1/completions", json=body, headers=headers
        ) as response:
            return response.status, dict(response.headers), await response.json()

    async def burst() -> list[tuple[int, dict, dict]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(6)))

    results = asyncio.run(burst())
    statuses = [status for status, _, _ in results]
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1
    for status, headers, body in results:
        if status == 429:
            assert headers["Retry-After"] == "1"
            assert body["error"]["type"] == "rate_limit_exceeded"
        else:
            assert status == 200 and body["usage"]["completion_tokens"] == 40


def test_an_oversized_body_gets_413_with_an_openai_error(guarded_server: Server) -> None:
    import urllib.error
    import urllib.request

    body = json.dumps({"prompt": "x" * (5 * 2**20)}).encode()
    request = urllib.request.Request(
        f"{guarded_server.url}/v1/completions", data=body, method="POST",
        headers={"Authorization": "Bearer sesame"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as failure:
        urllib.request.urlopen(request, timeout=30)
    assert failure.value.code == 413
    assert json.loads(failure.value.read())["error"]["message"]


def test_malformed_and_replayed_frames_are_counted_dropped_and_survived(
    service: Server, client: openai.OpenAI
) -> None:
    import msgspec
    import zmq

    from shared.protocol import AbortRequest, AddRequest, StepResult, pack_ids

    context = zmq.Context.instance()
    gateway_side = context.socket(zmq.PUSH)
    executor_side = context.socket(zmq.DEALER)
    gateway_side.connect(service.requests_address)
    executor_side.connect(service.executors_address)
    valid = msgspec.msgpack.encode(AbortRequest(12345))
    garbage = [b"", b"\xc1", valid[:-1], b"\x00" * 1000, msgspec.msgpack.encode({"x": [1, 2]})]
    for frame in garbage:
        gateway_side.send(frame)
        executor_side.send(frame)
    gateway_side.send(valid)  # an abort for a request that does not exist: ignored
    executor_side.send(msgspec.msgpack.encode(StepResult(step=1)))  # a replayed old result
    deadline = time.monotonic() + 10
    while True:
        series = service.scrape()
        requests_bad = series.get(
            'turnstile:malformed_frames_total{socket="scheduler.requests"}', 0
        )
        executors_bad = series.get(
            'turnstile:malformed_frames_total{socket="scheduler.executors"}', 0
        )
        if requests_bad >= len(garbage) and executors_bad >= len(garbage):
            break
        assert time.monotonic() < deadline, (requests_bad, executors_bad)
        time.sleep(0.2)
    # A replayed AddRequest must not end the live request that owns its id.
    before = service.scrape()
    replayed = msgspec.msgpack.encode(
        AddRequest(req_id=2_000_000_000, prompt_ids=pack_ids([5, 6, 7]), max_tokens=30)
    )
    gateway_side.send(replayed)
    gateway_side.send(replayed)
    # An oversized frame (over 64 MiB) makes ZeroMQ drop that connection, nothing more.
    oversized = context.socket(zmq.PUSH)
    oversized.connect(service.requests_address)
    oversized.send(b"x" * (65 * 2**20))
    deadline = time.monotonic() + 20
    while True:
        after = service.scrape()
        name = 'turnstile:malformed_frames_total{socket="scheduler.requests"}'
        length = 'turnstile:request_success_total{finished_reason="length"}'
        if after[name] == before[name] + 1 and after.get(length, 0) >= before.get(length, 0) + 1:
            break
        assert time.monotonic() < deadline, "the replay was not dropped, or the original died"
        time.sleep(0.2)
    assert after.get('turnstile:request_success_total{finished_reason="error"}', 0) == before.get(
        'turnstile:request_success_total{finished_reason="error"}', 0
    )
    for socket in (gateway_side, executor_side, oversized):
        socket.close(linger=0)
    answer = client.completions.create(model=MODEL, prompt="Still alive?", max_tokens=4)
    assert answer.usage.completion_tokens == 4


def test_a_mismatched_executor_is_refused_with_a_clear_reason(service: Server) -> None:
    import msgspec
    import zmq

    from shared.protocol import PROTOCOL_VERSION, Register, RegisterReply

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(service.executors_address)
    for wrong, words in (
        (dict(version=PROTOCOL_VERSION + 1), "version"),
        (dict(block_size=32), "block_size"),
        (dict(model="other-model"), "model"),
        (dict(rank=7), "rank 7"),
    ):
        hello = dict(version=PROTOCOL_VERSION, rank=0, model=MODEL, num_blocks=64,
                     block_size=16, max_num_seqs=32, max_model_len=8192) | wrong  # fmt: skip
        socket.send(msgspec.msgpack.encode(Register(**hello)))
        assert socket.poll(5000)
        reply = msgspec.msgpack.decode(socket.recv(), type=RegisterReply)
        assert not reply.accepted and words in reply.reason
    socket.close(linger=0)
    # The real executor is still the one serving.
    answer = openai.OpenAI(base_url=f"{service.url}/v1", api_key="x").completions.create(
        model=MODEL, prompt="Still serving?", max_tokens=3
    )
    assert answer.usage.completion_tokens == 3


def test_schemathesis_finds_no_server_error(tmp_path: Path) -> None:
    """Property-based requests generated from /openapi.json: never a 5xx, never a crash. The
    context is cut to 48 tokens so that generated requests finish quickly."""
    import shutil

    binary = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    with launched_server("--num-blocks", "64", "--max-model-len", "48") as server:
        done = subprocess.run(
            [binary, "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error",
             "--max-examples", "25", "--seed", "7", "--request-timeout", "60",
             "--generation-database", "none"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:]
        assert healthy(server.url)  # and still serving


def test_curve_keys_encrypt_the_links_and_shut_out_peers_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import zmq

    from shared.zmq_io import make_socket

    secret = subprocess.run(
        [sys.executable, "-m", "turnstile.cli", "keygen"], capture_output=True, text=True,
        check=True,
    ).stdout.strip()  # fmt: skip
    env = {"TURNSTILE_CURVE_SECRET_KEY": secret}
    with launched_server("--num-blocks", "64", env=env) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        answer = client.completions.create(model=MODEL, prompt="Secure?", max_tokens=3)
        assert answer.usage.completion_tokens == 3  # gateway and executor hold the key
        # A peer without the key never completes the handshake: no pipe, nothing to send on.
        intruder = zmq.Context.instance().socket(zmq.PUSH)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.setsockopt(zmq.IMMEDIATE, 1)  # a pipe only once the handshake succeeds
        intruder.connect(server.requests_address)
        assert not intruder.poll(2000, zmq.POLLOUT)
        intruder.close()
        # One with the key does, on the same socket.
        monkeypatch.setenv("TURNSTILE_CURVE_SECRET_KEY", secret)
        insider = make_socket(zmq.Context.instance(), zmq.PUSH, server.requests_address, False)
        assert insider.poll(5000, zmq.POLLOUT)
        insider.send(b"\xc1garbage")  # reaches the scheduler, which counts and drops it
        deadline = time.monotonic() + 10
        while not server.scrape().get(
            'turnstile:malformed_frames_total{socket="scheduler.requests"}', 0
        ):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        insider.close()
        assert client.completions.create(model=MODEL, prompt="Still?", max_tokens=2).usage
