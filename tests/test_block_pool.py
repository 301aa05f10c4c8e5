from __future__ import annotations

import numpy as np
import pytest

from turnstile.scheduler_svc.block_pool import BlockPool, chain_hashes, salt_root


def publish(
    pool: BlockPool, tokens: np.ndarray, blocks: list[int], block_size: int, root: int = 0
) -> list[int]:
    hashes = chain_hashes(tokens, block_size, root)
    parents = np.array([-1, *blocks[:-1]])
    pool.cache(
        np.array(blocks),
        np.array(hashes, dtype=np.uint64),
        parents,
        tokens.reshape(-1, block_size),
        root,
    )
    return hashes


def test_allocate_release_counts() -> None:
    pool = BlockPool(8, 4)
    blocks = pool.allocate(3)
    assert (pool.num_free, pool.num_used) == (5, 3)
    pool.share(blocks.tolist())
    pool.release(blocks)
    assert pool.num_free == 5
    pool.release(blocks)
    assert pool.num_free == 8
    with pytest.raises(MemoryError):
        pool.allocate(9)


def test_blank_blocks_go_before_cached_ones_and_cached_leave_in_lru_order() -> None:
    pool = BlockPool(4, 2)
    first = pool.allocate(2)
    publish(pool, np.array([5, 6, 7, 8]), first.tolist(), 2)
    pool.release(first[::-1])
    # Two blank blocks are handed out before either cached block is evicted.
    assert set(pool.allocate(2).tolist()).isdisjoint(first.tolist())
    # Then the least recently freed cached block (the tail, freed first) goes first.
    assert pool.allocate(1).tolist() == [first[1]]
    hashes = chain_hashes(np.array([5, 6, 7, 8]), 2, 0)
    assert pool.cached_prefix(hashes, np.array([[5, 6], [7, 8]])) == [first[0]]


def test_prefix_lookup_follows_the_chain_and_stops_at_the_first_miss() -> None:
    pool = BlockPool(8, 2)
    blocks = pool.allocate(3).tolist()
    tokens = np.array([1, 2, 3, 4, 5, 6])
    hashes = publish(pool, tokens, blocks, 2)
    assert pool.cached_prefix(hashes, tokens.reshape(3, 2)) == blocks
    other = np.array([1, 2, 9, 9, 5, 6])
    assert pool.cached_prefix(chain_hashes(other, 2, 0), other.reshape(3, 2)) == blocks[:1]


def test_a_hash_collision_is_a_miss_never_foreign_kv() -> None:
    pool = BlockPool(8, 2)
    blocks = pool.allocate(2).tolist()
    victim = np.array([1, 2, 3, 4])
    hashes = publish(pool, victim, blocks, 2)
    # An attacker who found tokens with the same chain hashes gets nothing.
    forged = np.array([[1, 2], [9, 9]])
    assert pool.cached_prefix(hashes, forged) == blocks[:1]
    assert pool.cached_prefix(hashes, np.array([[8, 8], [3, 4]])) == []


def test_a_reused_parent_block_invalidates_its_cached_children() -> None:
    pool = BlockPool(2, 2)
    blocks = pool.allocate(2).tolist()
    tokens = np.array([1, 2, 3, 4])
    hashes = publish(pool, tokens, blocks, 2)
    pool.release(np.array([blocks[0]]))  # the head is evicted first, the child stays cached
    reused = pool.allocate(1).tolist()
    assert reused == [blocks[0]]
    publish(pool, np.array([1, 2]), reused, 2)  # same tokens, new KV: a new stamp
    pool.release(np.array([blocks[1]]))
    # The child was computed after the old head, not the new one: it no longer matches.
    assert pool.cached_prefix(hashes, tokens.reshape(2, 2)) == reused


def test_requests_of_different_cache_salts_never_share_a_block() -> None:
    pool = BlockPool(8, 2)
    tokens = np.array([1, 2, 3, 4])
    a, b = salt_root("tenant-a"), salt_root("tenant-b")
    assert len({0, a, b}) == 3 and salt_root("") == 0
    mine = pool.allocate(2).tolist()
    hashes = publish(pool, tokens, mine, 2, a)
    assert pool.cached_prefix(hashes, tokens.reshape(2, 2), a) == mine  # the same salt hits
    for root in (b, 0):  # another salt, or none: a miss by hash
        assert pool.cached_prefix(chain_hashes(tokens, 2, root), tokens.reshape(2, 2), root) == []
    # A forged hash (one that found salt a's chain) still misses: the root is verified too.
    assert pool.cached_prefix(hashes, tokens.reshape(2, 2), b) == []
    assert pool.cached_prefix(hashes, tokens.reshape(2, 2)) == []
    theirs = pool.allocate(2).tolist()  # salt b publishes its own copy of the same tokens
    other = publish(pool, tokens, theirs, 2, b)
    assert pool.cached_prefix(other, tokens.reshape(2, 2), b) == theirs


def test_blocks_after_a_twin_of_a_cached_block_are_found_after_the_cached_one() -> None:
    """Two requests that computed the same first block in one step: the second's copy is not
    published (the first wins), yet the blocks it wrote after it are found after the first's."""
    pool = BlockPool(8, 2)
    first, twin = pool.allocate(2).tolist(), pool.allocate(3).tolist()
    publish(pool, np.array([1, 2, 3, 4]), first, 2)
    theirs = np.array([1, 2, 5, 6, 7, 8])
    hashes = publish(pool, theirs, twin, 2)
    assert pool.cached_prefix(hashes, theirs.reshape(3, 2)) == [first[0], *twin[1:]]
    # A block that shares only the hash (a collision) is no twin: nothing after it is linked.
    forged = pool.allocate(2)
    tail = chain_hashes(np.array([7, 8]), 2, hashes[0])
    pool.cache(forged, np.array([hashes[0], *tail], dtype=np.uint64), np.array([-1, forged[0]]),
               np.array([[9, 9], [7, 8]]))  # fmt: skip
    assert pool.cached_prefix([hashes[0], *tail], np.array([[1, 2], [7, 8]])) == [first[0]]
