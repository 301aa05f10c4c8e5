"""The scheduler's persistent batch: the shared columns plus what decides stops and victims."""

from __future__ import annotations

import numpy as np

from turnstile.scheduler_svc.request import Request, Status
from turnstile.shared.batch_table import BatchTable


class RunningBatch(BatchTable):
    def __init__(self, capacity: int, max_model_len: int, block_size: int) -> None:
        super().__init__(capacity, max_model_len, block_size)
        self.stop_len = np.zeros(capacity, dtype=np.int64)
        self.eos_token_id = np.full(capacity, -1, dtype=np.int32)
        self.has_stop_ids = np.zeros(capacity, dtype=bool)
        self.rank = np.zeros(capacity, dtype=np.int64)
        self.num_hashed = np.zeros(capacity, dtype=np.int64)
        self.last_hash = np.zeros(capacity, dtype=np.uint64)
        self.requests: list[Request | None] = [None] * capacity
        self.num_with_stop_ids = 0

    def admit(
        self, req: Request, block_ids: list[int], num_computed: int, by_priority: bool
    ) -> int:
        slot = self.add(
            req.req_id, req.token_ids, req.num_prompt_tokens, num_computed, np.array(block_ids)
        )
        self.stop_len[slot] = req.stop_len
        self.eos_token_id[slot] = req.eos_token_id
        self.has_stop_ids[slot] = bool(req.stop_token_ids)
        self.num_with_stop_ids += bool(req.stop_token_ids)
        self.rank[slot] = req.rank(by_priority)
        self.num_hashed[slot] = num_computed // self.block_size
        self.requests[slot] = req
        req.status = Status.RUNNING
        return slot

    def release(self, slot: int, keep_tokens: bool) -> tuple[Request, np.ndarray]:
        """Take a row out; returns its request and its blocks, tail first, for the pool."""
        req = self.requests[slot]
        assert req is not None
        if keep_tokens:
            req.token_ids = self.known_tokens(slot).copy()
        blocks = self.blocks_of(slot)[::-1].copy()
        self.requests[slot] = None
        self.num_with_stop_ids -= bool(self.has_stop_ids[slot])
        self.num_blocks[slot] = 0
        self.remove([req.req_id])
        return req, blocks
