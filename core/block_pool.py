"""KV blocks, the O(1) free queue that doubles as the LRU eviction order, and the block pool.

A block with ``ref_cnt == 0`` sits in the free queue. If it still carries a ``block_hash`` it is a
prefix-cache entry that can be revived by a later request (``touch``) until the pool hands it out
again (``allocate`` pops from the head and drops the hash). Freed blocks join at the tail, so the
least recently used cached block is evicted first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    prev_free: "KVCacheBlock | None" = None
    next_free: "KVCacheBlock | None" = None


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, linked through the blocks themselves.

    A Python deque would make ``remove`` O(n); a prefix-cache hit on a free block must take it out
    of the middle of the queue, so the links live in the blocks and every operation is O(1).
    """

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head: KVCacheBlock | None = None
        self._tail: KVCacheBlock | None = None
        self.num_free = 0
        self.extend(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head
        if block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The ``n`` blocks at the head, unlinked in one pass (the hot path of allocation)."""
        if n > self.num_free:
            raise IndexError(f"{n} blocks requested, {self.num_free} free")
        out = []
        append = out.append
        block = self._head
        for _ in range(n):
            append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self._head = block
        if block is None:
            self._tail = None
        else:
            block.prev_free = None
        self.num_free -= n
        return out

    def append(self, block: KVCacheBlock) -> None:
        self.extend((block,))

    def extend(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``append`` for each block in order, linked in one pass."""
        tail = self._tail
        for block in blocks:
            block.prev_free = tail
            if tail is None:
                self._head = block
            else:
                tail.next_free = block
            tail = block
        if tail is not None:
            tail.next_free = None
        self._tail = tail
        self.num_free += len(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None:
            self._head = nxt
        else:
            prev.next_free = nxt
        if nxt is None:
            self._tail = prev
        else:
            nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        block = self._head
        while block is not None:
            yield block
            block = block.next_free


class BlockPool:
    """A fixed set of blocks with reference counts and, optionally, a prefix-cache index."""

    __slots__ = ("blocks", "free_queue", "enable_caching", "cached", "num_evictions")

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be non-negative, got {num_blocks}.")
        self.blocks = list(map(KVCacheBlock, range(num_blocks)))
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[int, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        total = len(self.blocks)
        return 1.0 - self.free_queue.num_free / total if total else 0.0

    def lookup(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Takes ``n`` blocks from the head of the free queue; caller checked ``num_free``.

        A block carries a hash only while it is the cache's entry for that hash (``cache_all``
        sets both, first writer wins), so handing out such a block evicts exactly that entry."""
        out = self.free_queue.popleft_n(n)
        cached = self.cached
        num_cached = len(cached)
        for block in out:
            block.ref_cnt = 1
            if block.block_hash is not None:
                del cached[block.block_hash]
                block.block_hash = None
        self.num_evictions += num_cached - len(cached)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each. Callers pass tail blocks first so they are evicted first."""
        released = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.free_queue.extend(released)

    def cache(self, block: KVCacheBlock, block_hash: int) -> None:
        """Registers a full, computed block under its hash (first writer wins)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def cache_all(self, blocks: Iterable[KVCacheBlock], block_hashes: Iterable[int]) -> None:
        """Registers each full, computed block under its hash (first writer wins)."""
        cached = self.cached
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is None and block_hash not in cached:
                block.block_hash = block_hash
                cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use, as in vLLM."""
        if self.free_queue.num_free != len(self.blocks):
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True
