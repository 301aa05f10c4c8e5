"""ZeroMQ plumbing shared by the services: sockets on IPC paths in a private directory unless
told otherwise, and decoding that validates every frame and drops (logs, counts) the malformed
ones."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import zmq
from prometheus_client import Counter

from turnstile.shared.config import AddressConfig

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
            self.count_malformed(str(exc))
            return None

    def count_malformed(self, why: str) -> None:
        self._malformed.inc()
        log.warning("dropped a frame on %s: %s", self.socket_name, why)

    def receive_routed(self, socket: zmq.Socket) -> Iterator[tuple[bytes, T]]:
        """Every waiting message on a ROUTER socket with its sender's identity; a frame that is
        not exactly [identity, message], or does not decode, is counted and dropped."""
        while socket.poll(0):
            parts = socket.recv_multipart()
            if len(parts) != 2:
                self.count_malformed(f"a message of {len(parts) - 1} parts, not 1")
                continue
            message = self.decode(parts[1])
            if message is not None:
                yield parts[0], message


RUN_DIR_ENV = "TURNSTILE_RUN_DIR"


def private_dir(path: Path) -> Path:
    """`path`, created 0700 if absent; refused if another user owns it or may enter it, so no
    other local user can reach the IPC sockets inside."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RuntimeError(
            f"{path} must be a directory of this user's with mode 0700 (it holds the services' "
            f"sockets); it is owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):o}"
        )
    return path


def default_run_dir() -> Path:
    """Where services started one by one on this host meet: $TURNSTILE_RUN_DIR, else
    $XDG_RUNTIME_DIR/turnstile, else /tmp/turnstile-<uid>."""
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "turnstile" if runtime else Path(f"/tmp/turnstile-{os.getuid()}")


def ipc_address(run_dir: Path, name: str) -> str:
    return f"ipc://{run_dir / name}"


CURVE_ENV = "TURNSTILE_CURVE_SECRET_KEY"


class _DeploymentKeyOnly:
    """ZAP policy: a client is let in only if it holds the deployment's key pair."""

    def __init__(self, public_key: bytes) -> None:
        self.public_key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public_key


_authenticators: dict[int, object] = {}


def _curve_secret() -> bytes | None:
    secret = os.environ.get(CURVE_ENV)
    return secret.encode() if secret else None


def _secure(context: zmq.Context, socket: zmq.Socket, bind: bool) -> None:
    """With TURNSTILE_CURVE_SECRET_KEY set (`turnstile keygen` makes one), every link is
    encrypted and a peer without the same key pair cannot talk to a bound socket."""
    secret = _curve_secret()
    if secret is None:
        return
    public = zmq.curve_public(secret)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    if not bind:
        socket.curve_serverkey = public
        return
    socket.curve_server = True
    if id(context) not in _authenticators:
        from zmq.auth.thread import ThreadAuthenticator

        authenticator = ThreadAuthenticator(zmq.Context.instance())
        authenticator.start()
        authenticator.configure_curve_callback("*", _DeploymentKeyOnly(public))
        _authenticators[id(context)] = authenticator


def make_socket(
    context: zmq.Context, kind: int, address: str, bind: bool, routing_id: bytes | None = None
) -> zmq.Socket:
    socket = context.socket(kind)
    if routing_id is not None:
        socket.setsockopt(zmq.ROUTING_ID, routing_id)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    _secure(context, socket, bind)
    if bind:
        if address.startswith("ipc://"):
            private_dir(Path(address.removeprefix("ipc://")).parent)
        socket.bind(address)
    else:
        socket.connect(address)
    return socket


def scheduler_addresses(addresses: AddressConfig, run_dir: Path | None = None) -> tuple[str, str]:
    """The scheduler's two addresses, for gateways and for executors: as set, else IPC paths in
    `run_dir` (by default this host's private run directory)."""
    where = run_dir or default_run_dir()
    return (
        addresses.scheduler_address or ipc_address(where, "scheduler.sock"),
        addresses.executors_address or ipc_address(where, "executors.sock"),
    )
