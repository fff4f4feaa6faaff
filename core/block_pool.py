"""KV blocks, the O(1) free queue that doubles as the LRU eviction order, and the block pool.

A block with ``ref_cnt == 0`` sits in the free queue. If it still carries a ``block_hash`` it is a
prefix-cache entry that can be revived by a later request (``touch``) until the pool hands it out
again (``allocate`` pops from the head and drops the hash). Freed blocks join at the tail, so the
least recently used cached block is evicted first.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from twinserve.core.kv_events import KVEventBuffer


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


# Consumed entries are dropped from the front of the queue's list once they are this many and
# at least half of it; stale entries are swept once they outnumber the free blocks by this many.
_COMPACT_AT = 1024
_STALE_SLACK = 64


class FreeKVCacheBlockQueue:
    """Free blocks in LRU order: a list consumed from a head index.

    Popping ``n`` blocks is one slice and freeing one ``extend``, both in C, where a linked list
    would relink every block in Python. ``remove`` (a prefix-cache hit reviving a free block from
    the middle) leaves the block's entry in place and counts it stale instead; pops skip stale
    entries. A freed block always re-enters at the tail, so a block's stale entries precede its
    live one: of a block with ``k`` stale entries, the first ``k`` met are the stale ones. Every
    operation is O(1) amortised: the list is compacted as its consumed or stale part grows.
    """

    __slots__ = ("_items", "_head", "_stale", "_num_stale", "num_free", "_dropped", "_hashed",
                 "_hashed_from")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._items: list[KVCacheBlock] = []
        self._head = 0  # entries before it were popped
        self._dropped = 0  # entries compacted away: an entry's position is this + its index
        # The positions of the entries whose block carried a hash when it joined, ascending
        # (None until ``unhashed_at_head`` is first asked): every stale entry is among them.
        # Those before ``_hashed_from`` were consumed (dropped in bulk once they are most).
        self._hashed: list[int] | None = None
        self._hashed_from = 0
        self._stale: dict[KVCacheBlock, int] = {}  # block -> its stale entries at or after head
        self._num_stale = 0
        self.num_free = 0
        self.extend(blocks)

    def popleft(self) -> KVCacheBlock:
        if not self.num_free:
            raise IndexError("no free blocks")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The ``n`` blocks at the head (the hot path of allocation)."""
        if n > self.num_free:
            raise IndexError(f"{n} blocks requested, {self.num_free} free")
        head = self._head
        out = self._items[head:head + n]
        if self._stale and not self._stale.keys().isdisjoint(out):
            out = self._pop_skipping_stale(n)
        else:
            self._head = head + n
        self.num_free -= n
        if self._head >= _COMPACT_AT and 2 * self._head >= len(self._items):
            del self._items[:self._head]
            self._dropped += self._head
            self._head = 0
        return out

    def unhashed_at_head(self) -> int | None:
        """How many free blocks from the head (``peek``'s order) carry no hash, so handing
        that many out evicts nothing; None where none does. Read off the positions of the
        entries that joined with a hash, without touching a block: a free block gains no hash
        (only a block in use is registered), and revival finds a block by its hash, so the
        entries before the first such position are live and carry none. The positions are kept
        from the first call on."""
        hashed = self._hashed
        if hashed is None:
            hashed = self._track_hashed()
        head = self._dropped + self._head
        first = self._hashed_from
        if first < len(hashed) and hashed[first] < head:  # (consumed since: bisect past them)
            first = bisect_left(hashed, head, first + 1)
        if first >= _COMPACT_AT and 2 * first >= len(hashed):
            del hashed[:first]
            first = 0
        self._hashed_from = first
        return hashed[first] - head if first < len(hashed) else None

    def _track_hashed(self) -> list[int]:
        """Tracks, from now on, the positions of the entries whose block carries a hash or is
        stale (read from the queue as it is); returns them."""
        stale, at = self._stale, self._dropped + self._head
        self._hashed_from = 0
        self._hashed = [at + i for i, block in enumerate(self._items[self._head:])
                        if block.block_hash is not None or block in stale]
        return self._hashed

    def peek(self, n: int) -> list[KVCacheBlock]:
        """The blocks ``popleft_n(n)`` would return (at most the free ones), left in place."""
        head, items = self._head, self._items
        out = items[head:head + n]
        stale = self._stale
        if not stale or stale.keys().isdisjoint(out):
            return out
        skipped: dict[KVCacheBlock, int] = {}  # (not a copy of ``stale``: thousands of entries)
        out = []
        while len(out) < n and head < len(items):
            block = items[head]
            head += 1
            done = skipped.get(block, 0)
            if done < stale.get(block, 0):
                skipped[block] = done + 1
            else:
                out.append(block)
        return out

    def _pop_skipping_stale(self, n: int) -> list[KVCacheBlock]:
        items, stale, head = self._items, self._stale, self._head
        out: list[KVCacheBlock] = []
        while len(out) < n:
            block = items[head]
            head += 1
            if block in stale:
                self._drop_one_stale(block)
            else:
                out.append(block)
        self._head = head
        return out

    def _drop_one_stale(self, block: KVCacheBlock) -> None:
        k = self._stale[block]
        if k == 1:
            del self._stale[block]
        else:
            self._stale[block] = k - 1
        self._num_stale -= 1

    def append(self, block: KVCacheBlock) -> None:
        if self._hashed is not None and block.block_hash is not None:
            self._hashed.append(self._dropped + len(self._items))
        self._items.append(block)
        self.num_free += 1

    def extend(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``append`` for each block in order."""
        hashed = self._hashed
        if hashed is not None:
            at = self._dropped + len(self._items)
            hashed += [at + i for i, block in enumerate(blocks) if block.block_hash is not None]
        self._items += blocks
        self.num_free += len(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        """Takes a free block out of the queue (its entry turns stale)."""
        self._stale[block] = self._stale.get(block, 0) + 1
        self._num_stale += 1
        self.num_free -= 1
        if self._num_stale > self.num_free + _STALE_SLACK:
            self._items = list(self)
            self._head = self._dropped = 0
            self._stale.clear()
            self._num_stale = 0
            if self._hashed is not None:
                self._track_hashed()

    def __iter__(self) -> Iterator[KVCacheBlock]:
        skip = dict(self._stale)
        for block in self._items[self._head:]:
            k = skip.get(block)
            if k:
                skip[block] = k - 1
            else:
                yield block


class BlockPool:
    """A fixed set of blocks with reference counts and, optionally, a prefix-cache index."""

    __slots__ = ("blocks", "free_queue", "enable_caching", "cached", "num_evictions", "events")

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be non-negative, got {num_blocks}.")
        self.blocks = list(map(KVCacheBlock, range(num_blocks)))
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[int, KVCacheBlock] = {}
        self.num_evictions = 0
        # Where stores, evictions and resets are recorded (None: not recorded, the default). The
        # checks sit off the hot paths: in the eviction branch, and in cache_recorded, which the
        # KV manager calls in place of cache/cache_all when this is set.
        self.events: KVEventBuffer | None = None

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
            block_hash = block.block_hash
            if block_hash is not None:
                del cached[block_hash]
                block.block_hash = None
                if self.events is not None:
                    self.events.removed(block_hash)
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
        released: list[KVCacheBlock] = []
        release = released.append
        for block in blocks:
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            if not ref_cnt:
                release(block)
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

    def cache_recorded(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int],
                       parent_block_hash: int | None, lora: str | None) -> None:
        """``cache_all``, recording the blocks it registered as one ``BlockStored`` (needs
        ``events``). ``parent_block_hash``: the hash of the block before ``blocks[0]``."""
        assert self.events is not None
        cached = self.cached
        stored: list[int] = []
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is None and block_hash not in cached:
                block.block_hash = block_hash
                cached[block_hash] = block
                stored.append(block_hash)
        self.events.stored(stored, parent_block_hash, lora)

    def reset_prefix_cache(self, num_reserved: int = 0) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use, as in vLLM
        (``num_reserved``: blocks the owner holds for good, such as a null block)."""
        if self.free_queue.num_free + num_reserved != len(self.blocks):
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True
