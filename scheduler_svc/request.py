"""A request as the scheduler sees it, from arrival to its one and only end."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from shared.protocol import AddRequest, SamplingParams, unpack_ids

# Preemption and queue order key: (priority, arrival) packed in one int64, lower runs first.
_ARRIVAL_BITS = 40
_PRIORITY_LIMIT = 1 << 20


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    req_id: int
    token_ids: np.ndarray
    num_prompt_tokens: int
    stop_len: int
    eos_token_id: int
    stop_token_ids: frozenset[int]
    priority: int
    arrival: int
    sampling: SamplingParams
    status: Status = Status.WAITING
    finish_reason: str | None = None
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    arrived_at: float = 0.0  # the caller's clock; only queue deadlines read it

    @classmethod
    def from_message(
        cls, msg: AddRequest, arrival: int, eos_token_id: int, max_model_len: int
    ) -> Request:
        prompt = unpack_ids(msg.prompt_ids).copy()
        if not -_PRIORITY_LIMIT <= msg.priority < _PRIORITY_LIMIT:
            raise ValueError(f"priority must lie in [{-_PRIORITY_LIMIT}, {_PRIORITY_LIMIT})")
        return cls(
            req_id=msg.req_id,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            stop_len=min(len(prompt) + msg.max_tokens, max_model_len),
            eos_token_id=-1 if msg.ignore_eos else eos_token_id,
            stop_token_ids=frozenset(msg.stop_token_ids),
            priority=msg.priority,
            arrival=arrival,
            sampling=msg.sampling,
        )

    def rank(self, by_priority: bool) -> int:
        priority = self.priority + _PRIORITY_LIMIT if by_priority else 0
        return (priority << _ARRIVAL_BITS) | self.arrival
