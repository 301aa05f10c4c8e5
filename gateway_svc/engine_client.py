"""The gateway's side of the scheduler link: submit and abort requests, and route each step's
tokens to the request streams waiting for them."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from shared.protocol import (
    AbortRequest,
    AddRequest,
    EngineOutputs,
    FromScheduler,
    SchedulerStatus,
    unpack_ids,
)
from shared.zmq_io import FrameCodec, make_socket

log = logging.getLogger(__name__)

# Without a status for this long the scheduler is taken for dead (it sends one every 0.5 s).
SCHEDULER_SILENCE_LIMIT = 3.0
_MAX_REQ_ID = 2**31 - 1


@dataclass(slots=True)
class Token:
    token_id: int
    logprobs: list[tuple[int, float]]


@dataclass(slots=True)
class End:
    reason: str
    error: str = ""


@dataclass(slots=True)
class RequestStream:
    req_id: int
    events: asyncio.Queue[Token | End]


class EngineClient:
    def __init__(self, requests_address: str, outputs_address: str) -> None:
        context = zmq.asyncio.Context.instance()
        self._push = make_socket(context, zmq.PUSH, requests_address, bind=False)
        # Outputs are read by a plain socket drained from the event loop's reader callback:
        # an awaited poll and recv a message cost ~5x the CPU, taken from the executor here.
        plain = zmq.Context.shadow(context.underlying)
        self._pull = make_socket(plain, zmq.PULL, outputs_address, bind=False)
        self._codec: FrameCodec[FromScheduler] = FrameCodec(FromScheduler, "gateway.outputs")
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.cycle(range(1, _MAX_REQ_ID))
        self.status: SchedulerStatus | None = None
        self._status_time = 0.0
        self._watchdog: asyncio.Task[None] | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self._pull.getsockopt(zmq.FD), self._read_outputs)
        self._watchdog = loop.create_task(self._watch_silence())
        # ZeroMQ's descriptor signals edges: frames queued before now would raise no event.
        self._read_outputs()

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            asyncio.get_running_loop().remove_reader(self._pull.getsockopt(zmq.FD))
        self._push.close()
        self._pull.close()

    @property
    def ready(self) -> bool:
        alive = time.monotonic() - self._status_time < SCHEDULER_SILENCE_LIMIT
        return alive and self.status is not None and self.status.ready

    async def submit(self, request: AddRequest) -> RequestStream:
        """Send a request under a fresh id (its own req_id is ignored); returns its stream."""
        req_id = next(self._ids)
        while req_id in self._streams:
            req_id = next(self._ids)
        stream = RequestStream(req_id, asyncio.Queue())
        self._streams[req_id] = stream
        await self._push.send(self._codec.encode(msgspec.structs.replace(request, req_id=req_id)))
        return stream

    async def abort(self, stream: RequestStream) -> None:
        """Stop a request that is still running (no-op once it has ended)."""
        if self._streams.pop(stream.req_id, None) is not None:
            await self._push.send(self._codec.encode(AbortRequest(stream.req_id)))

    def _read_outputs(self) -> None:
        while self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            message = self._codec.decode(self._pull.recv(zmq.NOBLOCK))
            if isinstance(message, SchedulerStatus):
                if self.status is not None and message.instance != self.status.instance:
                    self._fail_all("the scheduler restarted")
                self.status, self._status_time = message, time.monotonic()
            elif isinstance(message, EngineOutputs):
                self._route(message)

    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(SCHEDULER_SILENCE_LIMIT / 3)
            if time.monotonic() - self._status_time > SCHEDULER_SILENCE_LIMIT:
                self._fail_all("the scheduler stopped answering")

    def _route(self, outputs: EngineOutputs) -> None:
        req_ids = unpack_ids(outputs.req_ids).tolist()
        token_ids = unpack_ids(outputs.token_ids).tolist()
        logprobs = outputs.logprobs or [[]] * len(req_ids)
        for req_id, token_id, top in zip(req_ids, token_ids, logprobs, strict=True):
            stream = self._streams.get(req_id)
            if stream is not None:
                stream.events.put_nowait(Token(token_id, top))
        for ended in outputs.finished:
            stream = self._streams.pop(ended.req_id, None)
            if stream is not None:
                stream.events.put_nowait(End(ended.reason, ended.error))

    def _fail_all(self, reason: str) -> None:
        if self._streams:
            log.error("%s; failing %d requests", reason, len(self._streams))
        for stream in self._streams.values():
            stream.events.put_nowait(End("unavailable", reason))
        self._streams.clear()
        self.status = None
