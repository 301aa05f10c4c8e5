"""The gateway's side of the scheduler link: submit and abort requests, and route each step's
tokens to the request streams waiting for them.

One DEALER socket under an identity new in every gateway process: the scheduler routes to this
gateway only its own requests' outputs, and ends them all if this process goes away.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from turnstile.shared.protocol import (
    AbortRequest,
    AddRequest,
    Embedding,
    EngineOutputs,
    FromScheduler,
    Heartbeat,
    SchedulerStatus,
    unpack_ids,
)
from turnstile.shared.zmq_io import FrameCodec, make_socket

log = logging.getLogger(__name__)

# Without a status for this long the scheduler is taken for dead (it sends one every 0.5 s).
# Time this gateway itself spent stalled (stopped, or its loop blocked) does not count.
SCHEDULER_SILENCE_LIMIT = 3.0
_WATCH_INTERVAL = SCHEDULER_SILENCE_LIMIT / 3
_LOCAL_ID_LIMIT = 2**24  # the scheduler's limit on a gateway's own request ids
_SEND_HIGH_WATER_MARK = 100_000


@dataclass(slots=True)
class Token:
    token_id: int
    logprobs: list[tuple[int, float]]


@dataclass(slots=True)
class PromptEntries:
    """Logprobs of prompt tokens `first`, `first` + 1, ...: [(token, logprob), top N...]."""

    first: int
    entries: list[list[tuple[int, float]]]
    ranks: list[int]


@dataclass(slots=True)
class End:
    reason: str
    error: str = ""
    cached_tokens: int = 0


@dataclass(slots=True)
class RequestStream:
    req_id: int
    events: asyncio.Queue[Token | PromptEntries | Embedding | End]
    deadline: asyncio.TimerHandle | None = field(default=None, repr=False)


class EngineClient:
    def __init__(self, address: str, request_timeout: float) -> None:
        # A plain socket drained from the event loop's reader callback: an awaited poll and
        # recv cost several times the CPU, taken from the executor (docs/benchmarks.md).
        identity = b"gateway-" + secrets.token_hex(8).encode()
        self._socket = make_socket(
            zmq.Context.instance(), zmq.DEALER, address, bind=False, routing_id=identity
        )
        self._socket.setsockopt(zmq.SNDHWM, _SEND_HIGH_WATER_MARK)
        self._codec: FrameCodec[FromScheduler] = FrameCodec(FromScheduler, "gateway.outputs")
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.cycle(range(1, _LOCAL_ID_LIMIT))
        self.request_timeout = request_timeout
        self.status: SchedulerStatus | None = None
        self._status_time = 0.0
        self._watchdog: asyncio.Task[None] | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self._socket.getsockopt(zmq.FD), self._read_outputs)
        self._watchdog = loop.create_task(self._watch_silence())
        self._send(Heartbeat(0))  # introduces us, so status arrives before any request
        # ZeroMQ's descriptor signals edges: frames queued before now would raise no event.
        self._read_outputs()

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            asyncio.get_running_loop().remove_reader(self._socket.getsockopt(zmq.FD))
        self._socket.close()

    @property
    def ready(self) -> bool:
        alive = time.monotonic() - self._status_time < SCHEDULER_SILENCE_LIMIT
        return alive and self.status is not None and self.status.ready

    def submit(self, request: AddRequest) -> RequestStream:
        """Send a request under a fresh id (its own req_id is ignored); returns its stream,
        which ends by `request_timeout` at the latest."""
        req_id = next(self._ids)
        while req_id in self._streams:
            req_id = next(self._ids)
        stream = RequestStream(req_id, asyncio.Queue())
        self._streams[req_id] = stream
        if not self._send(msgspec.structs.replace(request, req_id=req_id)):
            self._end(stream, End("unavailable", "the scheduler is not reading requests"))
            return stream
        stream.deadline = asyncio.get_running_loop().call_later(
            self.request_timeout, self._expire, stream
        )
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Stop a request that is still running (no-op once it has ended)."""
        if self._streams.get(stream.req_id) is stream:
            self._end(stream, None)
            self._send(AbortRequest(stream.req_id))

    def stop(self, stream: RequestStream) -> None:
        """Stop a request whose end the gateway found (a stop string); its stream still gets
        the scheduler's `End`, with the request's counts."""
        if self._streams.get(stream.req_id) is stream:
            self._send(AbortRequest(stream.req_id))

    def _send(self, message: msgspec.Struct) -> bool:
        try:
            self._socket.send(self._codec.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        finally:
            # A send can take the descriptor's edge for frames that arrived meanwhile.
            asyncio.get_running_loop().call_soon(self._read_outputs)
        return True

    def _end(self, stream: RequestStream, event: End | None) -> None:
        del self._streams[stream.req_id]
        if stream.deadline is not None:
            stream.deadline.cancel()
        if event is not None:
            stream.events.put_nowait(event)

    def _expire(self, stream: RequestStream) -> None:
        if self._streams.get(stream.req_id) is stream:
            error = f"the request did not finish within {self.request_timeout:g} s"
            self._end(stream, End("timeout", error))
            self._send(AbortRequest(stream.req_id))

    def _read_outputs(self) -> None:
        while self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            message = self._codec.decode(self._socket.recv(zmq.NOBLOCK))
            if isinstance(message, SchedulerStatus):
                if self.status is not None and message.instance != self.status.instance:
                    self._fail_all("the scheduler restarted")
                self.status, self._status_time = message, time.monotonic()
            elif isinstance(message, EngineOutputs):
                self._route(message)

    async def _watch_silence(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(_WATCH_INTERVAL)
            now = time.monotonic()
            self._status_time += max(now - last - _WATCH_INTERVAL - 0.25, 0.0)  # our own stall
            last = now
            self._read_outputs()  # what arrived while we were stalled, before judging
            self._send(Heartbeat(0))  # a restarted scheduler learns of us from it
            if now - self._status_time > SCHEDULER_SILENCE_LIMIT:
                self._fail_all("the scheduler stopped answering")

    def _route(self, outputs: EngineOutputs) -> None:
        try:
            req_ids = unpack_ids(outputs.req_ids).tolist()
            token_ids = unpack_ids(outputs.token_ids).tolist()
        except ValueError as exc:
            self._codec.count_malformed(str(exc))
            return
        for prompt in outputs.prompt_logprobs:  # before the tokens that follow the prompt
            stream = self._streams.get(prompt.req_id)
            if stream is not None:
                stream.events.put_nowait(PromptEntries(prompt.first, prompt.entries, prompt.ranks))
        for embedding in outputs.embeddings:  # likewise
            stream = self._streams.get(embedding.req_id)
            if stream is not None:
                stream.events.put_nowait(embedding)
        logprobs = outputs.logprobs or [[]] * len(req_ids)
        if not len(req_ids) == len(token_ids) == len(logprobs):
            self._codec.count_malformed("outputs whose ids, tokens and logprobs differ in length")
            return
        for req_id, token_id, top in zip(req_ids, token_ids, logprobs, strict=True):
            stream = self._streams.get(req_id)
            if stream is not None:
                stream.events.put_nowait(Token(token_id, top))
        for ended in outputs.finished:
            stream = self._streams.get(ended.req_id)
            if stream is not None:
                self._end(stream, End(ended.reason, ended.error, ended.cached_tokens))

    def _fail_all(self, reason: str) -> None:
        """Fail every request, and abort each: a scheduler that was only slow would run on."""
        if self._streams:
            log.error("%s; failing %d requests", reason, len(self._streams))
        for stream in list(self._streams.values()):
            self._end(stream, End("unavailable", reason))
            self._send(AbortRequest(stream.req_id))
        self.status = None
