"""The scheduler's side of its gateways: who is connected, whose request is whose, and each
step's outputs sent only to the gateway that asked.

A gateway numbers its requests itself; the scheduler keys them by (gateway, number) packed in
one int32, `slot << 24 | number`, so two gateways, or a gateway and its restarted successor,
never share a key, and a gateway can neither see nor abort another's requests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TypeVar

import msgspec
import numpy as np
import zmq

from turnstile.shared.protocol import (
    Embedding,
    EngineOutputs,
    Finished,
    PromptLogprobs,
    ToScheduler,
    pack_ids,
    unpack_ids,
)
from turnstile.shared.zmq_io import FrameCodec, make_socket

log = logging.getLogger(__name__)

LOCAL_ID_BITS = 24
LOCAL_ID_LIMIT = 1 << LOCAL_ID_BITS  # a gateway's own request ids lie below this
MAX_GATEWAYS = 127  # slots 1..127 keep a key below 2**31
# Buffered for a stalled gateway (stopped, or busy tokenizing) rather than dropped: its streams
# resume intact when it reads again.
SEND_HIGH_WATER_MARK = 100_000
Keyed = TypeVar("Keyed", Finished, PromptLogprobs, Embedding)


class GatewayLink:
    def __init__(self, address: str) -> None:
        self.socket = make_socket(zmq.Context.instance(), zmq.ROUTER, address, bind=True)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        # ZeroMQ's own heartbeats close a connection whose peer vanished without a word (a host
        # gone): the disconnect then reports it as for a killed process.
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        self.disconnects = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.codec: FrameCodec[ToScheduler] = FrameCodec(ToScheduler, "scheduler.requests")
        self.slots: dict[bytes, int] = {}  # gateway identity -> slot
        self.identities: dict[int, bytes] = {}  # slot -> gateway identity
        # Slots of gateways that are gone, kept from reuse until none of their requests is
        # left: a successor in the same slot would otherwise be handed their tokens.
        self.retired: set[int] = set()

    def receive(self) -> Iterator[tuple[int, ToScheduler]]:
        """Every waiting message with its gateway's slot; a newly seen gateway takes a free
        slot (a message from one more than MAX_GATEWAYS is counted and dropped)."""
        for identity, message in self.codec.receive_routed(self.socket):
            slot = self.slots.get(identity)
            if slot is None:
                slot = self._attach(identity)
                if slot is None:
                    self.codec.count_malformed(f"more than {MAX_GATEWAYS} gateways")
                    continue
            yield slot, message

    def key(self, slot: int, local_id: int) -> int | None:
        """The scheduler's key for a gateway's request id, or None if the id is out of range."""
        return slot << LOCAL_ID_BITS | local_id if 0 <= local_id < LOCAL_ID_LIMIT else None

    def refuse(self, slot: int, local_id: int, reason: str, error: str) -> None:
        self._send(slot, EngineOutputs(step=0, finished=[Finished(local_id, reason, error)]))

    def send_outputs(self, outputs: EngineOutputs) -> None:
        """Each gateway gets its own requests' tokens and endings, under its own ids."""
        keys = unpack_ids(outputs.req_ids)
        owners = keys >> LOCAL_ID_BITS
        ended = _by_owner(outputs.finished)
        prompts = _by_owner(outputs.prompt_logprobs)
        vectors = _by_owner(outputs.embeddings)
        for slot in set(np.unique(owners).tolist()) | set(ended) | set(prompts) | set(vectors):
            mine = owners == slot
            every = bool(mine.all())
            logprobs = outputs.logprobs
            if logprobs and not every:
                logprobs = [entry for entry, keep in zip(logprobs, mine, strict=True) if keep]
            tokens = outputs.token_ids if every else pack_ids(unpack_ids(outputs.token_ids)[mine])
            message = EngineOutputs(
                step=outputs.step,
                req_ids=pack_ids((keys if every else keys[mine]) & (LOCAL_ID_LIMIT - 1)),
                token_ids=tokens,
                finished=ended.get(slot, []),
                logprobs=logprobs,
                prompt_logprobs=prompts.get(slot, []),
                embeddings=vectors.get(slot, []),
            )
            self._send(slot, message)

    def broadcast(self, message: msgspec.Struct) -> list[int]:
        """Send to every gateway; returns the slots of those that are gone, now retired."""
        frame = self.codec.encode(message)
        gone = [slot for slot in list(self.identities) if not self._send_frame(slot, frame)]
        for slot in gone:
            del self.slots[self.identities.pop(slot)]
            self.retired.add(slot)
        return gone

    def release(self, live_keys: Iterable[int]) -> None:
        """Retired slots none of whose requests is among `live_keys` become free again."""
        if self.retired:
            self.retired &= {key >> LOCAL_ID_BITS for key in live_keys}

    def _attach(self, identity: bytes) -> int | None:
        taken = self.identities.keys() | self.retired
        free = next((s for s in range(1, MAX_GATEWAYS + 1) if s not in taken), None)
        if free is not None:
            self.slots[identity] = free
            self.identities[free] = identity
        return free

    def _send(self, slot: int, message: msgspec.Struct) -> None:
        self._send_frame(slot, self.codec.encode(message))

    def _send_frame(self, slot: int, frame: bytes) -> bool:
        """False only when the gateway is gone; a full buffer drops the frame (logged) rather
        than blocking the scheduler."""
        identity = self.identities.get(slot)
        if identity is None:
            return True  # detached already; its requests are being ended
        try:
            self.socket.send_multipart([identity, frame], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.error("gateway slot %d reads nothing; dropped a message for it", slot)
        except zmq.ZMQError:  # EHOSTUNREACH: its connection is gone
            return False
        return True


def _by_owner(items: list[Keyed]) -> dict[int, list[Keyed]]:
    """Each gateway's share of `items` (keyed by the scheduler's request keys), under its own
    request ids."""
    owned: dict[int, list[Keyed]] = {}
    for item in items:
        local = msgspec.structs.replace(item, req_id=item.req_id & (LOCAL_ID_LIMIT - 1))
        owned.setdefault(item.req_id >> LOCAL_ID_BITS, []).append(local)
    return owned
