"""The scheduler's side of its executors: who is registered, how a plan reaches every one of
them, and how a vanished one is noticed in milliseconds rather than a heartbeat later."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import zmq

from turnstile.shared.protocol import PROTOCOL_VERSION, ExecutorToScheduler, Heartbeat, Register
from turnstile.shared.zmq_io import FrameCodec, make_socket


class ExecutorLink:
    def __init__(
        self,
        address: str,
        block_size: int,
        max_num_seqs: int,
        model: str,
        vocab_size: int,
        tensor_parallel_size: int = 1,
    ) -> None:
        self.socket = make_socket(zmq.Context.instance(), zmq.ROUTER, address, bind=True)
        self.codec: FrameCodec[ExecutorToScheduler] = FrameCodec(
            ExecutorToScheduler, "scheduler.executors"
        )
        self.expected = (PROTOCOL_VERSION, block_size, max_num_seqs, model, vocab_size)
        self.ranks = tensor_parallel_size
        self.peers: dict[int, bytes] = {}  # rank -> ZeroMQ identity
        self.offers: dict[int, Register] = {}  # rank -> what it registered with
        # A killed executor's TCP connection drops at once: the monitor reports it in
        # milliseconds, where a heartbeat would take seconds.
        # Any peer's drop raises it, a stray client's too, so each executor is then probed:
        # with ROUTER_MANDATORY a send to a vanished peer fails at once.
        self.disconnects = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)

    @property
    def complete(self) -> bool:
        """Every rank of the model is registered."""
        return len(self.peers) == self.ranks

    def receive(self) -> Iterator[tuple[bytes, ExecutorToScheduler]]:
        """Every well-formed waiting message with its sender (malformed ones are counted)."""
        return self.codec.receive_routed(self.socket)

    def rank_of(self, identity: bytes) -> int | None:
        return next((rank for rank, known in self.peers.items() if known == identity), None)

    def alive(self, rank: int) -> bool:
        """Whether the process registered for this rank still has its connection."""
        identity = self.peers.get(rank)
        return identity is not None and self.send_to(identity, Heartbeat(-1))

    def send_to(self, identity: bytes, message: msgspec.Struct) -> bool:
        return self._send(identity, self.codec.encode(message))

    def broadcast(self, message: msgspec.Struct) -> tuple[int, int | None]:
        """Send to every registered executor: the frame's size, and the rank of the first
        executor that could not take it, if one could not."""
        frame = self.codec.encode(message)
        for rank, identity in list(self.peers.items()):
            if not self._send(identity, frame):
                return len(frame), rank
        return len(frame), None

    def probe(self) -> int | None:
        """The rank of an executor that is gone, if one is."""
        return self.broadcast(Heartbeat(-1))[1]

    def refusal(self, hello: Register) -> str:
        """Why this executor cannot join, or "" if it can."""
        offered = (
            hello.version, hello.block_size, hello.max_num_seqs, hello.model, hello.vocab_size
        )  # fmt: skip
        if offered != self.expected:
            return (
                f"executor offers (version, block_size, max_num_seqs, model, vocab_size) = "
                f"{offered}; this scheduler runs {self.expected}"
            )
        if not 0 <= hello.rank < self.ranks:
            return f"rank {hello.rank}: this scheduler drives ranks 0 to {self.ranks - 1}"
        shape = ("num_blocks", "max_model_len")
        for rank, other in self.offers.items():
            if rank != hello.rank and rank in self.peers:
                differ = [f"{name} {getattr(hello, name)} where rank {rank} has "
                          f"{getattr(other, name)}" for name in shape
                          if getattr(hello, name) != getattr(other, name)]  # fmt: skip
                if differ:
                    return f"rank {hello.rank} disagrees with its group: {', '.join(differ)}"
        return ""

    def _send(self, identity: bytes, frame: bytes) -> bool:
        try:
            self.socket.send_multipart([identity, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # EHOSTUNREACH: gone; EAGAIN: not reading at all
            return False
        return True
