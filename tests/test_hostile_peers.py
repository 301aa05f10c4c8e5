"""Local processes that talk to the ZeroMQ ports without being Turnstile services: each abuse runs
beside a live stream, which must end with its undisturbed text, and the services stay up."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from conftest import MODEL
from test_failures import start_streams

from turnstile.bench.server_process import Server, launched_server
from turnstile.shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    AddRequest,
    EngineOutputs,
    FromScheduler,
    Heartbeat,
    Register,
    RegisterReply,
    StepResult,
    pack_ids,
)
from turnstile.shared.zmq_io import private_dir

pytestmark = pytest.mark.slow  # starts a stack or loads models

PROMPT = "Write a list of 5 fruits and their colors:"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with launched_server("--num-blocks", "128", "--max-num-seqs", "4") as running:
        yield running


@pytest.fixture(scope="module")
def undisturbed(server: Server) -> str:
    return beside(server, None)


def beside(server: Server, abuse: Callable[[], None] | None) -> str:
    """The text of a greedy stream with `abuse` run once it is under way."""

    async def run() -> str:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            [task], under_way = start_streams(session, server.url, [PROMPT], max_tokens=256)
            if abuse is not None:
                await under_way()
                await asyncio.to_thread(abuse)
            text, errors = await task
            assert not errors
            return text

    return asyncio.run(run())


def peer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def listen(sock: zmq.Socket, seconds: float, until_outputs: bool = False) -> list[object]:
    """What the scheduler sends this peer within `seconds` (up to its first outputs if asked)."""
    heard: list[object] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if until_outputs and any(isinstance(m, EngineOutputs) for m in heard):
            break
        if sock.poll(100):
            heard.append(msgspec.msgpack.decode(sock.recv(), type=FromScheduler))
    return heard


def malformed(server: Server, name: str) -> float:
    return server.scrape().get(f'turnstile:malformed_frames_total{{socket="{name}"}}', 0)


def test_a_frame_of_two_parts_on_the_executors_port_is_dropped(
    server: Server, undisturbed: str
) -> None:
    before = malformed(server, "scheduler.executors")

    def abuse() -> None:
        sock = peer(server.executors_address)
        sock.send_multipart([b"name", msgspec.msgpack.encode(Heartbeat(0))])
        time.sleep(0.3)
        sock.close()

    assert beside(server, abuse) == undisturbed
    assert malformed(server, "scheduler.executors") > before


def test_results_from_an_unregistered_peer_are_dropped(server: Server, undisturbed: str) -> None:
    before = malformed(server, "scheduler.executors")

    def abuse() -> None:
        sock = peer(server.executors_address)
        for step in range(1, 3000):  # whatever step is in flight, well-formed or not
            sock.send(msgspec.msgpack.encode(StepResult(step=step, sampled=pack_ids([7]))))
            sock.send(msgspec.msgpack.encode(StepResult(step=step, sampled=b"\x01")))
        # Open until all are read: frames still queued when a peer leaves are lost with it.
        deadline = time.monotonic() + 30
        while malformed(server, "scheduler.executors") < before + 5998:
            assert time.monotonic() < deadline, malformed(server, "scheduler.executors") - before
            time.sleep(0.1)
        sock.close()

    assert beside(server, abuse) == undisturbed


def test_a_register_for_a_live_rank_is_refused(server: Server, undisturbed: str) -> None:
    replies: list[RegisterReply] = []

    def abuse() -> None:
        sock = peer(server.executors_address)
        hello = Register(
            version=PROTOCOL_VERSION, rank=0, model=MODEL, vocab_size=49152, num_blocks=128,
            block_size=16, max_num_seqs=4, max_model_len=8192,
        )  # fmt: skip
        sock.send(msgspec.msgpack.encode(hello))
        assert sock.poll(5000)
        replies.append(msgspec.msgpack.decode(sock.recv(), type=RegisterReply))
        sock.send(msgspec.msgpack.encode(StepResult(step=1)))  # and results, as rank 0
        sock.close()

    assert beside(server, abuse) == undisturbed
    assert not replies[0].accepted and "live executor" in replies[0].reason


def test_token_ids_outside_the_vocabulary_are_refused_by_the_scheduler(
    server: Server, undisturbed: str
) -> None:
    refusals: list[EngineOutputs] = []

    def abuse() -> None:
        sock = peer(server.scheduler_address)
        bad = AddRequest(req_id=9, prompt_ids=pack_ids([5, 49152 + 7]), max_tokens=4)
        sock.send(msgspec.msgpack.encode(bad))  # past the gateway's own check
        heard = listen(sock, 10, until_outputs=True)
        refusals.extend(m for m in heard if isinstance(m, EngineOutputs))
        sock.close()

    assert beside(server, abuse) == undisturbed  # the executor never saw it
    [ended] = refusals[0].finished
    assert (ended.req_id, ended.reason) == (9, "error") and "prompt token ids" in ended.error


def test_a_stranger_cannot_abort_other_clients_requests(server: Server, undisturbed: str) -> None:
    def abuse() -> None:
        sock = peer(server.scheduler_address)
        for req_id in range(1, 2000):
            sock.send(msgspec.msgpack.encode(AbortRequest(req_id)))
        time.sleep(0.5)
        sock.close()

    assert beside(server, abuse) == undisturbed


def test_a_second_reader_gets_status_but_no_one_elses_tokens(
    server: Server, undisturbed: str
) -> None:
    seen: list[object] = []

    def abuse() -> None:
        sock = peer(server.scheduler_address)
        sock.send(msgspec.msgpack.encode(Heartbeat(0)))
        seen.extend(listen(sock, 2))
        sock.close()

    assert beside(server, abuse) == undisturbed
    assert seen and not any(isinstance(m, EngineOutputs) for m in seen)


def test_serve_binds_ipc_sockets_in_a_directory_only_its_user_can_enter() -> None:
    with launched_server("--num-blocks", "64", addresses=False) as server:
        bound = [c.laddr for c in server.service("scheduler").net_connections(kind="unix")]
        path = Path(next(p for p in bound if p.endswith("/scheduler.sock")))
        info = path.parent.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        if os.getuid() == 0:  # as CI runs: another user is shut out by the directory's mode
            probe = (
                "import os, socket; os.setgid(65534); os.setuid(65534); "
                f"socket.socket(socket.AF_UNIX).connect({str(path)!r})"
            )
            done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
            assert "PermissionError" in done.stderr
        with socket.socket(socket.AF_UNIX) as own:
            own.connect(str(path))  # while its own user gets in


def test_a_run_directory_others_may_enter_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "run"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(RuntimeError, match="mode 0700"):
        private_dir(shared)
    assert stat.S_IMODE(private_dir(tmp_path / "fresh").stat().st_mode) == 0o700
