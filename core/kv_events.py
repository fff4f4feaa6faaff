"""KV-cache events, vLLM's names: what a replica's prefix cache gained and lost, by block hash.

A block pool records them only when the scheduler config enables them (``kv_events``), into a
bounded ``KVEventBuffer`` that ``Scheduler.take_kv_events`` drains. A router reads them to learn
which prompt blocks each replica holds (``routers/cache_aware.py``). The hashes are those of
``core.block_hash``, so a router hashing a prompt's blocks with the same block size finds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Events kept between two drains; past it the buffer keeps one AllBlocksCleared instead (a reader
# then forgets the replica's blocks: it underestimates what the replica holds, never the reverse).
DEFAULT_CAPACITY = 1 << 16


@dataclass(slots=True)
class BlockStored:
    """Full blocks registered in the prefix cache, in prompt order; ``parent_block_hash``: the
    hash of the block before the first (None: the first is the prompt's first block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    lora: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks evicted (their blocks handed out for other tokens)."""

    block_hashes: list[int]


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: the replica holds no cached block."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBuffer:
    """The events since the last ``take``, bounded by ``capacity``.

    Evictions come one block at a time from the pool's hot path: they gather in one pending
    ``BlockRemoved`` that closes when another kind of event comes or on ``take``."""

    capacity: int = DEFAULT_CAPACITY
    num_overflows: int = 0
    _events: list[KVCacheEvent] = field(default_factory=list)
    _removed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {self.capacity!r}.")

    def stored(self, block_hashes: list[int], parent_block_hash: int | None,
               lora: str | None) -> None:
        if block_hashes:
            self._flush_removed()
            self._add(BlockStored(block_hashes, parent_block_hash, lora))

    def removed(self, block_hash: int) -> None:
        self._removed.append(block_hash)

    def cleared(self) -> None:
        self._removed.clear()
        self._events.clear()  # what came before is moot
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        if self._removed:  # (a fleet's front takes every replica's at every arrival)
            self._flush_removed()
        taken, self._events = self._events, []
        return taken

    def _flush_removed(self) -> None:
        if self._removed:
            self._add(BlockRemoved(self._removed))
            self._removed = []

    def _add(self, event: KVCacheEvent) -> None:
        if len(self._events) >= self.capacity:
            self.num_overflows += 1
            self._events.clear()
            self._events.append(AllBlocksCleared())
            return  # the event itself is lost with the rest: the reader starts from empty
        self._events.append(event)
