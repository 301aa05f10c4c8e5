"""ZeroMQ plumbing shared by the services: sockets bound to loopback unless told otherwise,
and decoding that validates every frame and drops (logs, counts) the malformed ones."""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

import msgspec
import zmq
from prometheus_client import Counter

log = logging.getLogger(__name__)

T = TypeVar("T")

MALFORMED_FRAMES = Counter(
    "turnstile:malformed_frames",
    "ZeroMQ frames dropped because they did not decode to a valid message",
    ["socket"],
)
MAX_FRAME_BYTES = 64 * 2**20


class FrameCodec(Generic[T]):
    """Encodes any message; decodes only the message types given, validating them."""

    def __init__(self, accepted: Any, socket_name: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(accepted)
        self._encoder = msgspec.msgpack.Encoder()
        self._malformed = MALFORMED_FRAMES.labels(socket_name)
        self.socket_name = socket_name

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes) -> T | None:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._malformed.inc()
            log.warning("dropped a malformed frame on %s: %s", self.socket_name, exc)
            return None


def make_socket(context: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)
    return socket
