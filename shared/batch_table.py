"""The persistent batch: columnar, slot-indexed state of the running requests.

The scheduler and every executor keep one each and change it by the same rules, so a plan only
has to say what changed. Rows keep a stable order (removal never reorders survivors, new rows go
last); per-step work is numpy over all rows, never a Python loop per request.
"""

from __future__ import annotations

import numpy as np


def cdiv(a: np.ndarray | int, b: int) -> np.ndarray | int:
    return -(-a // b)


def within_rows(counts: np.ndarray) -> np.ndarray:
    """For rows of `counts[i]` entries laid end to end, each entry's index within its row."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def spread(last: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each row's `counts[i]` consecutive values ending at `last[i]`, rows concatenated."""
    return np.repeat(last - counts + 1, counts) + within_rows(counts)


class BatchTable:
    def __init__(self, capacity: int, max_model_len: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        # Counters and indices are int64: numpy indexes with int64 three times faster.
        self.req_ids = np.full(capacity, -1, dtype=np.int64)
        # A column past the context: a pooled prompt of the whole context samples its one
        # (never answered) token there.
        self.tokens = np.zeros((capacity, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(capacity, dtype=np.int64)
        self.num_prompt = np.zeros(capacity, dtype=np.int64)
        self.num_computed = np.zeros(capacity, dtype=np.int64)
        self.block_table = np.zeros((capacity, int(cdiv(max_model_len, block_size))), np.int64)
        self.num_blocks = np.zeros(capacity, dtype=np.int64)
        self.order = np.empty(0, dtype=np.int64)
        self.slot_of: dict[int, int] = {}
        self._free_slots = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.order)

    def add(
        self,
        req_id: int,
        token_ids: np.ndarray,
        num_prompt: int,
        num_computed: int,
        block_ids: np.ndarray,
    ) -> int:
        if req_id in self.slot_of:
            raise ValueError(f"request {req_id} is already in the batch")
        if not self._free_slots:
            raise ValueError("the batch is full")
        slot = self._free_slots.pop()
        n, nb = len(token_ids), len(block_ids)
        self.req_ids[slot] = req_id
        self.tokens[slot, :n] = token_ids
        self.num_tokens[slot] = n
        self.num_prompt[slot] = num_prompt
        self.num_computed[slot] = num_computed
        self.block_table[slot, :nb] = block_ids
        self.num_blocks[slot] = nb
        self.slot_of[req_id] = slot
        self.order = np.append(self.order, slot)
        return slot

    def remove(self, req_ids: list[int] | np.ndarray) -> list[int]:
        """Drop rows by request id, keeping the survivors' order; returns the freed slots."""
        slots = [self.slot_of.pop(int(r)) for r in req_ids]
        if slots:
            self.order = self.order[~np.isin(self.order, slots)]
            self.req_ids[slots] = -1
            self._free_slots.extend(slots)
        return slots

    # The plan's two implicit rules, applied alike by the scheduler and every executor.

    def decode_block_rows(self, rows: np.ndarray) -> np.ndarray:
        """In a steady decode step (every row computes one token), the rows that take a new
        block: those whose computed tokens fill their blocks exactly."""
        return rows[self.num_computed[rows] % self.block_size == 0]

    def samples(self, rows: np.ndarray) -> np.ndarray:
        """Which of `rows` sample a token once this step is computed: those whose every known
        token is then computed."""
        return self.num_computed[rows] == self.num_tokens[rows]

    def blocks_needed(self, rows: np.ndarray, scheduled: np.ndarray) -> np.ndarray:
        """Blocks each row must gain so its KV covers the tokens it computes this step."""
        return cdiv(self.num_computed[rows] + scheduled, self.block_size) - self.num_blocks[rows]

    def extend_blocks(self, rows: np.ndarray, need: np.ndarray, block_ids: np.ndarray) -> None:
        """Append `need[i]` ids of `block_ids` (taken in row order) to the table of `rows[i]`."""
        if len(block_ids) != int(need.sum()):
            raise ValueError(f"{len(block_ids)} new block ids for {int(need.sum())} needed")
        if len(block_ids) == 0:
            return
        owners = np.repeat(rows, need)
        cols = self.num_blocks[owners]
        if len(block_ids) > np.count_nonzero(need):  # some row takes several blocks
            cols += within_rows(need)
        self.block_table[owners, cols] = block_ids
        self.num_blocks[rows] += need

    def append_blocks(self, rows: np.ndarray, block_ids: np.ndarray) -> None:
        """One more block for each row (the decode case of `extend_blocks`)."""
        self.block_table[rows, self.num_blocks[rows]] = block_ids
        self.num_blocks[rows] += 1

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        self.tokens[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def append_drafts(self, slots: np.ndarray, counts: np.ndarray, tokens: np.ndarray) -> None:
        """Speculative decoding: `counts[i]` drafted tokens (`tokens`, rows concatenated) after
        the known tokens of `slots[i]`, computed this step as if they were known."""
        owners = np.repeat(slots, counts)
        self.tokens[owners, self.num_tokens[owners] + within_rows(counts)] = tokens
        self.num_tokens[slots] += counts

    def keep_drafted(
        self, slots: np.ndarray, first: np.ndarray, emitted: list[np.ndarray]
    ) -> np.ndarray:
        """After a step with drafts: row `slots[i]`'s tokens from index `first[i]` on are
        `emitted[i]` (the drafts that stood, then the token sampled after them). Returns the
        blocks that only turned-down drafts reached, which the rows no longer hold."""
        dropped = []
        for slot, start, tokens in zip(slots.tolist(), first.tolist(), emitted, strict=True):
            self.tokens[slot, start : start + len(tokens)] = tokens
            self.num_tokens[slot] = start + len(tokens)
            self.num_computed[slot] = start + len(tokens) - 1
            keep = int(cdiv(self.num_computed[slot], self.block_size))
            dropped.append(self.block_table[slot, keep : self.num_blocks[slot]][::-1])
            self.num_blocks[slot] = keep
        return np.concatenate(dropped) if dropped else np.empty(0, dtype=np.int64)

    def known_tokens(self, slot: int) -> np.ndarray:
        return self.tokens[slot, : self.num_tokens[slot]]

    def blocks_of(self, slot: int) -> np.ndarray:
        return self.block_table[slot, : self.num_blocks[slot]]

    def positions_of(self, req_ids: np.ndarray) -> np.ndarray:
        """Row positions (indices into `order`) of the given requests."""
        position_of_slot = np.empty(self.capacity, dtype=np.int64)
        position_of_slot[self.order] = np.arange(len(self.order))
        return position_of_slot[[self.slot_of[int(r)] for r in req_ids]]
