"""A fleet replica's decode run as a router sees it before the run is applied.

Behind a router that reads the replicas (``routers.reads_loads``), every arrival reads every
replica's load and, for a router that reads them, its KV events, as they stand at that instant.
Applying each replica's decode run up to every arrival, and stepping the step in progress through
the scheduler, costs a full step per replica per arrival. Instead a replica whose run nothing is
released to goes on with it through the arrivals (``simulator.engine._lazy_run``), and the
arrival reads its state from the run: ``PendingRun``.

At an arrival during step ``c`` of a run (steps ``0 .. c - 1`` ended before it, ``c`` was
scheduled and has not ended), the step-by-step reference holds:

- the run's requests all running: a lazy run stops at its first finish (the end of its first
  segment), so none has ended before the arrival; the requests released to the replica during
  the step waiting (the run applies at the end of that step);
- no prompt tokens left but the waiting ones' (the running requests all decode);
- the blocks taken by every decode, in steps ``0 .. c``, that started a block, one each, off the
  head of the free queue (no block is freed before a finish);
- KV events: an eviction for each of those blocks that carried a prefix-cache hash; no store,
  for a lazy run is one whose requests register no block while they decode (their own tokens,
  deferred by the cache: ``KVCacheManager.registration_stop``).

The evictions reported ahead are struck from the events the run makes when it is applied, so
the router hears each once, in the reference's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twinserve.core.decode_run import DecodeRun
from twinserve.core.kv_cache_manager import KVCacheManager
from twinserve.core.kv_events import BlockRemoved, KVCacheEvent
from twinserve.routers import ReplicaLoad


def lazy_fits(run: DecodeRun) -> bool:
    """Whether ``run`` may go on through arrivals unapplied: a plain one-group manager (whose
    block starts ``PendingRun`` counts), and no request registering a block as it decodes."""
    kv = run.scheduler.kv
    if type(kv) is not KVCacheManager or kv.sliding_window is not None \
            or kv.key_salt is not None or kv.num_groups != 1:
        return False
    if not kv.enable_caching:
        return True
    if not kv.defers_own_blocks:
        return False
    # (``registration_stop`` registers nothing more once the first block of the request's own
    # tokens, ``own_ids_from // block_size``, is within the blocks already handled)
    tables, bs = kv.tables, kv.block_size
    for request in run.requests:
        own = request.own_ids_from
        if own is None or own // bs > tables[request.request_id].num_cached_blocks:
            return False
    return True


@dataclass(slots=True)
class PendingRun:
    """A decode run computed ahead and not applied; ``crossing``: the step in progress."""

    run: DecodeRun
    crossing: int = 0
    _counted: tuple[int, int] = (-1, 0)  # (crossing, blocks taken up to it)
    _peeked: int = 0  # blocks of the free queue's head read
    reported: list[int] = field(default_factory=list)  # evictions reported ahead

    def blocks_taken(self) -> int:
        """The blocks the steps up to the crossing one took when they were scheduled."""
        c = self.crossing
        if self._counted[0] != c:
            bs = self.run.scheduler.kv.block_size
            taken = 0
            for start in self.run.starts:
                first = -start % bs  # its first step that starts a block
                if first <= c:
                    taken += (c - first) // bs + 1
            self._counted = (c, taken)
        return self._counted[1]

    def load(self) -> ReplicaLoad:
        """The replica's load in the crossing step, as the reference holds it."""
        sched = self.run.scheduler
        pool = sched.kv.pool
        total = len(pool.blocks)
        free = pool.free_queue.num_free - self.blocks_taken()
        return ReplicaLoad(len(sched.running), len(sched.policy),
                           1.0 - free / total if total else 0.0, True, sched.num_queued_tokens)

    def evictions(self) -> list[KVCacheEvent]:
        """The evictions of the blocks taken up to the crossing step not reported yet (as one
        ``BlockRemoved``, the pool's way), remembered in ``reported``."""
        taken = self.blocks_taken()
        if taken == self._peeked:
            return []
        blocks = self.run.scheduler.kv.pool.free_queue.peek(taken)[self._peeked:]
        hashes = [b.block_hash for b in blocks if b.block_hash is not None]
        self._peeked = taken
        self.reported += hashes
        return [BlockRemoved(hashes)] if hashes else []


def strike(events: list[KVCacheEvent], reported: list[int]) -> list[KVCacheEvent]:
    """``events`` without one eviction of each hash in ``reported`` (reported ahead)."""
    left: dict[int, int] = {}
    for block_hash in reported:
        left[block_hash] = left.get(block_hash, 0) + 1
    out: list[KVCacheEvent] = []
    for event in events:
        if isinstance(event, BlockRemoved) and left:
            kept = []
            for block_hash in event.block_hashes:
                if left.get(block_hash):
                    left[block_hash] -= 1
                else:
                    kept.append(block_hash)
            if kept:
                out.append(BlockRemoved(kept))
        else:
            out.append(event)
    if any(left.values()):
        raise RuntimeError("a decode run did not evict the blocks reported ahead")
    return out
