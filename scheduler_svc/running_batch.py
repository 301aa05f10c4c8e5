"""The scheduler's persistent batch: the shared columns plus what decides stops and victims.

A row that samples in a step is given its token's place at once, a placeholder filled in when
the result comes back, so the next step can be planned while this one runs."""

from __future__ import annotations

import numpy as np

from turnstile.scheduler_svc.request import Request, Status
from turnstile.shared.batch_table import BatchTable

PLACEHOLDER = -1  # a sampled token not back yet; token ids are never negative


class RunningBatch(BatchTable):
    def __init__(self, capacity: int, max_model_len: int, block_size: int) -> None:
        super().__init__(capacity, max_model_len, block_size)
        self.stop_len = np.zeros(capacity, dtype=np.int64)
        self.stops_at_eos = np.zeros(capacity, dtype=bool)
        self.has_stop_ids = np.zeros(capacity, dtype=bool)
        self.speculates = np.zeros(capacity, dtype=bool)  # may verify drafts (`Request`)
        self.rank = np.zeros(capacity, dtype=np.int64)
        self.num_hashed = np.zeros(capacity, dtype=np.int64)
        # Leading blocks given back to the pool behind a sliding window (their ids stay in
        # the table, and no query reads them again).
        self.num_released = np.zeros(capacity, dtype=np.int64)
        self.last_hash = np.zeros(capacity, dtype=np.uint64)
        # Which admission holds the slot: a late result for a row that has left (and whose
        # slot another request took) is told apart by it.
        self.admission = np.full(capacity, -1, dtype=np.int64)
        self.requests: list[Request | None] = [None] * capacity
        self.num_with_stop_ids = 0
        self._admissions = 0

    def admit(
        self, req: Request, block_ids: list[int], num_computed: int, by_priority: bool
    ) -> int:
        slot = self.add(
            req.req_id, req.token_ids, req.num_prompt_tokens, num_computed, np.array(block_ids)
        )
        self.stop_len[slot] = req.stop_len
        self.stops_at_eos[slot] = req.stops_at_eos
        self.has_stop_ids[slot] = bool(req.stop_token_ids)
        self.num_with_stop_ids += bool(req.stop_token_ids)
        self.speculates[slot] = req.speculates
        self.rank[slot] = req.rank(by_priority)
        self.num_hashed[slot] = num_computed // self.block_size
        self.num_released[slot] = 0
        self.admission[slot] = self._admissions
        self._admissions += 1
        self.requests[slot] = req
        req.status = Status.RUNNING
        return slot

    def release(self, slot: int, keep_tokens: bool) -> tuple[Request, np.ndarray]:
        """Take a row out; returns its request and the blocks it holds, tail first, for the
        pool."""
        req = self.requests[slot]
        assert req is not None
        if keep_tokens:
            req.token_ids = self.real_tokens(slot).copy()
        blocks = self.blocks_of(slot)[self.num_released[slot] :][::-1].copy()
        self.requests[slot] = None
        self.admission[slot] = -1
        self.num_with_stop_ids -= bool(self.has_stop_ids[slot])
        self.num_blocks[slot] = 0
        self.remove([req.req_id])
        return req, blocks

    def real_tokens(self, slot: int) -> np.ndarray:
        """The row's tokens without the placeholders of steps still in flight (at its end)."""
        end = int(self.num_tokens[slot])
        while end > self.num_prompt[slot] and self.tokens[slot, end - 1] == PLACEHOLDER:
            end -= 1
        return self.tokens[slot, :end]

    def wanted(self, rows: np.ndarray) -> np.ndarray:
        """Tokens each row has yet to compute; a row that reached its length computes no more
        (its last token's place is held while its step runs)."""
        return np.minimum(self.num_tokens[rows], self.stop_len[rows] - 1) - self.num_computed[rows]

    def hold_places(self, rows: np.ndarray) -> np.ndarray:
        """A placeholder for the token each of `rows` samples this step; returns its index."""
        index = self.num_tokens[rows]
        self.num_tokens[rows] = index + 1
        self.tokens[rows, index] = PLACEHOLDER
        return index

    def fill_places(self, rows: np.ndarray, index: np.ndarray, tokens: np.ndarray) -> None:
        self.tokens[rows, index] = tokens

    def release_behind(self, window: int) -> list[np.ndarray]:
        """Each row's blocks that no query from its next token on can see (every layer slides
        over `window` tokens), marked released; returns them for the pool."""
        rows = self.order
        # The next query sits at num_computed and sees keys from num_computed - window + 1 on.
        unseen = np.maximum(self.num_computed[rows] - window + 1, 0) // self.block_size
        behind = np.flatnonzero(unseen > self.num_released[rows])
        released = []
        for slot, end in zip(rows[behind].tolist(), unseen[behind].tolist(), strict=True):
            released.append(self.block_table[slot, self.num_released[slot] : end][::-1].copy())
            self.num_released[slot] = end
        return released
