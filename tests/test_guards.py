"""Guards end to end: API keys, overload, oversized bodies, malformed and replayed frames,
refused executors, generated requests (schemathesis), encrypted links."""

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
from conftest import MODEL

from turnstile.bench.server_process import Server, healthy, launched_server

pytestmark = pytest.mark.slow  # starts a stack or loads models

# Sampled answers (the API's default temperature is 1) may end at EOS before max_tokens.
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def guarded_server() -> Iterator[Server]:
    """One running sequence, at most one waiting, an API key, one origin a page may call from."""
    with launched_server(
        "--num-blocks", "128", "--max-num-seqs", "1", "--max-waiting", "1",
        "--api-key", "sesame", "--allowed-origins", '["http://ui.example"]',
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

    from turnstile.shared.protocol import AbortRequest, AddRequest, StepResult, pack_ids

    context = zmq.Context.instance()
    gateway_side = context.socket(zmq.DEALER)
    executor_side = context.socket(zmq.DEALER)
    gateway_side.connect(service.scheduler_address)
    executor_side.connect(service.executors_address)
    valid = msgspec.msgpack.encode(AbortRequest(12345))
    counted = ('turnstile:malformed_frames_total{socket="scheduler.requests"}',
               'turnstile:malformed_frames_total{socket="scheduler.executors"}')  # fmt: skip
    start = service.scrape()  # the stack is the session's: other modules' frames came before
    garbage = [b"", b"\xc1", valid[:-1], b"\x00" * 1000, msgspec.msgpack.encode({"x": [1, 2]})]
    for frame in garbage:
        gateway_side.send(frame)
        executor_side.send(frame)
    for side in (gateway_side, executor_side):  # two parts where one is expected
        side.send_multipart([valid, valid])
    garbage.append(b"two parts")
    gateway_side.send(valid)  # an abort for a request that does not exist: ignored
    executor_side.send(msgspec.msgpack.encode(StepResult(step=1)))  # a replayed old result
    deadline = time.monotonic() + 10
    while True:
        series = service.scrape()
        requests_bad, executors_bad = (series.get(n, 0) - start.get(n, 0) for n in counted)
        if requests_bad >= len(garbage) and executors_bad >= len(garbage):
            break
        assert time.monotonic() < deadline, (requests_bad, executors_bad)
        time.sleep(0.2)
    # A replayed AddRequest must not end the live request that owns its id.
    before = service.scrape()
    replayed = msgspec.msgpack.encode(
        AddRequest(req_id=1_000_000, prompt_ids=pack_ids([5, 6, 7]), max_tokens=30)
    )
    gateway_side.send(replayed)
    gateway_side.send(replayed)
    # An oversized frame (over 64 MiB) makes ZeroMQ drop that connection, nothing more.
    oversized = context.socket(zmq.DEALER)
    oversized.connect(service.scheduler_address)
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
    answer = client.completions.create(
        model=MODEL, prompt="Still alive?", max_tokens=4, extra_body=NO_EOS
    )
    assert answer.usage.completion_tokens == 4


def test_a_mismatched_executor_is_refused_with_a_clear_reason(service: Server) -> None:
    import msgspec
    import zmq

    from turnstile.shared.protocol import PROTOCOL_VERSION, Register, RegisterReply

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(service.executors_address)
    for wrong, words in (
        (dict(version=PROTOCOL_VERSION + 1), "version"),
        (dict(block_size=32), "block_size"),
        (dict(model="other-model"), "model"),
        (dict(vocab_size=50000), "vocab_size"),
        (dict(rank=7), "rank 7"),
    ):
        hello = dict(version=PROTOCOL_VERSION, rank=0, model=MODEL, vocab_size=49152,
                     num_blocks=64, block_size=16, max_num_seqs=32, max_model_len=8192,
                     ) | wrong  # fmt: skip
        socket.send(msgspec.msgpack.encode(Register(**hello)))
        assert socket.poll(5000)
        reply = msgspec.msgpack.decode(socket.recv(), type=RegisterReply)
        assert not reply.accepted and words in reply.reason
    socket.close(linger=0)
    # The real executor is still the one serving.
    answer = openai.OpenAI(base_url=f"{service.url}/v1", api_key="x").completions.create(
        model=MODEL, prompt="Still serving?", max_tokens=3, extra_body=NO_EOS
    )
    assert answer.usage.completion_tokens == 3


def test_a_page_from_an_allowed_origin_may_call_the_api_and_no_other_may(
    guarded_server: Server,
) -> None:
    """CORS, as a browser checks it: the preflight (no API key: a browser sends none) answers
    the allowed origin, and the API's answers name it; another origin's preflight is refused
    and its answers name no origin."""
    import urllib.error
    import urllib.request

    def call(method: str, origin: str, **headers: str) -> tuple[int, dict[str, str]]:
        url = f"{guarded_server.url}/v1/chat/completions"
        request = urllib.request.Request(url, method=method, headers={"Origin": origin, **headers})
        try:
            with urllib.request.urlopen(request, data=b"{}" if method == "POST" else None) as r:
                return r.status, dict(r.headers)
        except urllib.error.HTTPError as refused:
            return refused.code, dict(refused.headers)

    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    status, headers = call("OPTIONS", "http://ui.example", **preflight)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://ui.example"
    assert "AUTHORIZATION" in headers["Access-Control-Allow-Headers"].upper()
    status, headers = call("POST", "http://ui.example", Authorization="Bearer sesame")
    assert status == 400 and headers["Access-Control-Allow-Origin"] == "http://ui.example"
    assert call("POST", "http://ui.example")[0] == 401  # the key still guards the API
    assert call("OPTIONS", "http://elsewhere.example", **preflight)[0] == 403
    status, headers = call("POST", "http://elsewhere.example", Authorization="Bearer sesame")
    assert "Access-Control-Allow-Origin" not in headers


def test_schemathesis_finds_no_server_error(tmp_path: Path) -> None:
    """Property-based requests generated from /openapi.json: never a 5xx, never a crash. On a
    tiny random model, a context of 32 tokens and answers of at most 2, so that the ~450
    requests that generate are quick (docs/benchmarks.md, session 55)."""
    import shutil

    from test_tensor_parallel import tiny_llama

    binary = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    model = tiny_llama(tmp_path / "tiny")
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    capped = '{"max_new_tokens": 2}'
    flags = ["--model", str(model), "--num-blocks", "64", "--max-model-len", "32",
             "--chat-template", template, "--override-generation-config", capped]  # fmt: skip
    with launched_server(*flags) as server:
        done = subprocess.run(
            [binary, "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error",
             "--max-examples", "25", "--seed", "7", "--request-timeout", "60", "--workers", "2",
             "--generation-database", "none"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:]
        assert healthy(server.url)  # and still serving


def test_the_api_answers_over_https_with_the_certificate_it_is_given(tmp_path: Path) -> None:
    """vLLM's --ssl-certfile and --ssl-keyfile: a client that trusts the certificate's CA gets
    its answers; one that does not, or that speaks plain HTTP, gets none."""
    import ssl

    import trustme

    authority = trustme.CA()
    issued = authority.issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    issued.private_key_pem.write_to_path(tmp_path / "key.pem")
    tls = ["--ssl-certfile", str(tmp_path / "cert.pem"), "--ssl-keyfile", str(tmp_path / "key.pem")]
    with launched_server("--num-blocks", "64", *tls) as server:
        assert server.url.startswith("https://")
        trusting = ssl.create_default_context()
        authority.configure_trust(trusting)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                               http_client=openai.DefaultHttpxClient(verify=trusting))  # fmt: skip
        answer = client.completions.create(
            model=MODEL, prompt="Secure?", max_tokens=3, extra_body=NO_EOS
        )
        assert answer.usage.completion_tokens == 3
        stranger = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIConnectionError):  # the certificate is not trusted
            stranger.models.list()
        plain = openai.OpenAI(
            base_url=server.url.replace("https:", "http:") + "/v1", api_key="x", max_retries=0
        )
        with pytest.raises(openai.APIConnectionError):
            plain.models.list()


def test_curve_keys_encrypt_the_links_and_shut_out_peers_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import zmq

    from turnstile.shared.zmq_io import make_socket

    secret = subprocess.run(
        [sys.executable, "-m", "turnstile.cli", "keygen"], capture_output=True, text=True,
        check=True,
    ).stdout.strip()  # fmt: skip
    env = {"TURNSTILE_CURVE_SECRET_KEY": secret}
    with launched_server("--num-blocks", "64", env=env) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        answer = client.completions.create(
            model=MODEL, prompt="Secure?", max_tokens=3, extra_body=NO_EOS
        )
        assert answer.usage.completion_tokens == 3  # gateway and executor hold the key
        # A peer without the key never completes the handshake: no pipe, nothing to send on.
        intruder = zmq.Context.instance().socket(zmq.DEALER)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.setsockopt(zmq.IMMEDIATE, 1)  # a pipe only once the handshake succeeds
        intruder.connect(server.scheduler_address)
        assert not intruder.poll(2000, zmq.POLLOUT)
        intruder.close()
        # One with the key does, on the same socket.
        monkeypatch.setenv("TURNSTILE_CURVE_SECRET_KEY", secret)
        insider = make_socket(zmq.Context.instance(), zmq.DEALER, server.scheduler_address, False)
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
