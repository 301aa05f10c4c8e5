"""Prefix caching between the running batch and the block pool: find a request's cached
prefix on admission, publish a row's completed blocks for later requests."""

from __future__ import annotations

import numpy as np

from turnstile.scheduler_svc.block_pool import BlockPool, chain_hashes
from turnstile.scheduler_svc.request import Request
from turnstile.scheduler_svc.running_batch import RunningBatch


class PrefixCache:
    def __init__(self, pool: BlockPool, batch: RunningBatch) -> None:
        self.pool = pool
        self.batch = batch

    def lookup(self, req: Request) -> list[int]:
        """Cached blocks of the request's known tokens, leaving at least one token to compute
        (its logits give the next token). Nothing is taken yet."""
        if not self.pool.enable_caching:
            return []
        block_size = self.batch.block_size
        hashes = req.block_hashes
        done = len(hashes) * block_size
        root = req.cache_root
        hashes += chain_hashes(req.token_ids[done:], block_size, hashes[-1] if hashes else root)
        usable = (len(req.token_ids) - 1) // block_size
        token_blocks = req.token_ids[: usable * block_size].reshape(usable, block_size)
        return self.pool.cached_prefix(hashes[:usable], token_blocks, root)

    def publish(self, slot: int) -> None:
        """Offer the row's newly completed blocks to later requests. The scheduler calls it for
        rows that prefilled this step and for rows leaving the batch; decode steps skip it,
        since a block filled by decoding is only worth sharing once its owner is done. Blocks
        the row gave back behind a sliding window are never published: another request may
        hold them already, and a later prefix would be handed its KV."""
        batch = self.batch
        req = batch.requests[slot]
        assert req is not None  # a row publishes before it leaves
        block_size = batch.block_size
        start, full = int(batch.num_hashed[slot]), int(batch.num_computed[slot]) // block_size
        if full <= start:
            return
        tokens = batch.tokens[slot, start * block_size : full * block_size]
        hashes = chain_hashes(tokens, block_size, int(batch.last_hash[slot]))
        table = batch.block_table[slot]
        parents = table[start - 1 : full - 1] if start else np.r_[-1, table[: full - 1]]
        held = slice(max(int(batch.num_released[slot]) - start, 0), None)
        self.pool.cache(
            table[start:full][held],
            np.array(hashes, dtype=np.uint64)[held],
            parents[held],
            tokens.reshape(-1, block_size)[held],
            req.cache_root,
        )
        batch.last_hash[slot] = hashes[-1]
        batch.num_hashed[slot] = full
