"""KV block allocator with reference counts and exactly verified prefix caching.

A full block is indexed by a 64-bit chain hash of its tokens and its parent's hash. The hash is
fast rather than strong, because a hit is never trusted on the hash alone: the pool keeps each
cached block's tokens and the cache stamp of its parent block, so a lookup accepts a block only
if its tokens match and its parent is the block just accepted before it. A collision, crafted
or not, costs a miss, never another request's KV. A request's cache salt (`salt_root`) seeds
its chain and stands for its first block's parent, so requests of different salts never share a
block, whatever their tokens.

A block whose last owner leaves keeps its hash and goes to the tail of the free queue;
allocation takes from the head (least recently freed) and only then forgets the hash, so cached
prefixes survive as long as memory allows. Every operation touches only the blocks involved.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict

import numpy as np

_MASK = (1 << 64) - 1
_CHAIN_MULTIPLIER = 0x9E3779B97F4A7C15
_ROOT_STAMP = 0  # the parent stamp of a sequence's first block
_NOT_CACHED = -1


@functools.cache
def _token_weights(block_size: int) -> np.ndarray:
    return np.random.default_rng(block_size).integers(1, 1 << 63, block_size, np.uint64) | 1


def salt_root(salt: str, lora: str = "") -> int:
    """The chain's seed for a cache salt and a LoRA adapter's digest (0 for neither); odd, so
    never an unsalted chain's 0."""
    if not salt and not lora:
        return 0
    key = salt.encode() if not lora else f"{salt}\0lora {lora}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()) | 1


def root_stamp(root: int) -> int:
    """The parent stamp of a chain's first block: issued stamps are positive, a salt's are
    below -1 (-1 marks a block not cached)."""
    return _ROOT_STAMP if root == 0 else -2 - (root >> 2)


def block_contents(blocks: np.ndarray) -> np.ndarray:
    """One uint64 per row of a [n, block_size] token array (wrapping arithmetic)."""
    return (blocks.astype(np.uint64) * _token_weights(blocks.shape[1])).sum(axis=1)


def chain_hashes(token_ids: np.ndarray, block_size: int, parent: int) -> list[int]:
    """Chain hashes of every full block of one token sequence, after `parent`."""
    full = len(token_ids) // block_size
    contents = block_contents(token_ids[: full * block_size].reshape(full, block_size))
    hashes = []
    for content in contents.tolist():
        parent = (parent * _CHAIN_MULTIPLIER + content) & _MASK
        hashes.append(parent)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_count = np.zeros(num_blocks, dtype=np.int64)
        # Free blocks in two tiers: blank ones (a stack) go first; idle cached ones (LRU order)
        # are evicted only when no blank block is left.
        self._blank = list(range(num_blocks - 1, -1, -1))
        self._idle_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_of = np.zeros(num_blocks, dtype=np.uint64)
        self._block_of: dict[int, int] = {}
        self._tokens = np.zeros((num_blocks, block_size), dtype=np.int32)
        self._stamp = np.full(num_blocks, _NOT_CACHED, dtype=np.int64)
        self._parent_stamp = np.full(num_blocks, _NOT_CACHED, dtype=np.int64)
        # The stamp a block's children are published under: its own, or the cached twin's.
        self._link = np.full(num_blocks, _NOT_CACHED, dtype=np.int64)
        self._stamps_issued = 0

    @property
    def num_free(self) -> int:
        return len(self._blank) + len(self._idle_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def is_free(self, block: int) -> bool:
        return self.ref_count[block] == 0

    def allocate(self, count: int) -> np.ndarray:
        if count > self.num_free:
            raise MemoryError(f"asked for {count} KV blocks, {self.num_free} free")
        from_blank = min(count, len(self._blank))
        blocks = self._blank[len(self._blank) - from_blank :]
        del self._blank[len(self._blank) - from_blank :]
        for _ in range(count - from_blank):
            block = self._idle_cached.popitem(last=False)[0]
            del self._block_of[int(self._hash_of[block])]
            self._stamp[block] = _NOT_CACHED
            blocks.append(block)
        allocated = np.array(blocks, dtype=np.int64)
        self.ref_count[allocated] = 1
        self._link[allocated] = _NOT_CACHED
        return allocated

    def release(self, blocks: np.ndarray) -> None:
        """Drop one reference from each block; pass a request's blocks tail first, so the tail
        of a prefix is evicted before its head."""
        self.ref_count[blocks] -= 1
        for block in blocks[self.ref_count[blocks] == 0].tolist():
            if self._stamp[block] == _NOT_CACHED:
                self._blank.append(block)
            else:
                self._idle_cached[block] = None

    def cached_prefix(
        self, hashes: list[int], token_blocks: np.ndarray, root: int = 0
    ) -> list[int]:
        """Blocks holding the longest cached prefix of `token_blocks` ([n, block_size], with
        their chain `hashes` from `root`), verified token for token; none of them is taken."""
        found = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            found.append(block)
        if not found:
            return found
        blocks = np.array(found)
        parents = np.concatenate(([root_stamp(root)], self._stamp[blocks[:-1]]))
        valid = (self._tokens[blocks] == token_blocks[: len(found)]).all(axis=1)
        valid &= self._parent_stamp[blocks] == parents
        return found if valid.all() else found[: int(np.argmin(valid))]

    def cached_tokens(self, block: int) -> np.ndarray | None:
        """The tokens a prefix lookup takes the block to hold; None if it is not published."""
        return None if self._stamp[block] == _NOT_CACHED else self._tokens[block]

    def share(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks, pulling idle ones out of the free queue."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self._idle_cached[block]
        self.ref_count[blocks] += 1

    def cache(
        self,
        blocks: np.ndarray,
        hashes: np.ndarray,
        parents: np.ndarray,
        tokens: np.ndarray,
        root: int = 0,
    ) -> None:
        """Publish blocks whose KV is complete. `parents` are the physical blocks before them
        (-1 for a first block, of a chain from `root`). The first block with a given hash wins; a
        later one holding its tokens after the same chain is its twin (two requests computed it
        in one step): it stays unpublished, and the blocks after it are published as the
        winner's children, so that a lookup finds them."""
        if not self.enable_caching or len(blocks) == 0:
            return
        block_of, links, published = self._block_of, [], []
        first = root_stamp(root) if parents[0] < 0 else int(self._link[parents[0]])
        link = first
        for i, (block, block_hash) in enumerate(zip(blocks.tolist(), hashes.tolist(), strict=True)):
            winner = block_of.get(block_hash)
            if link == _NOT_CACHED:
                pass  # after a block no lookup reaches, nor does one reach this
            elif winner is None:
                block_of[block_hash] = block
                published.append(i)
                link = self._stamps_issued + len(published)
            elif self._parent_stamp[winner] == link and (self._tokens[winner] == tokens[i]).all():
                link = int(self._stamp[winner])
            else:
                link = _NOT_CACHED
            links.append(link)
        self._link[blocks] = links
        if not published:
            return
        chosen = blocks[published]
        self._stamps_issued += len(chosen)
        self._hash_of[chosen] = hashes[published]
        self._stamp[chosen] = self._link[chosen]
        self._parent_stamp[chosen] = np.array([first, *links[:-1]])[published]
        self._tokens[chosen] = tokens[published]
