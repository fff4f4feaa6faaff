"""A fleet replica's decode run as a router sees it before the run is applied.

Behind a router that reads the replicas (``routers.reads_loads``), every arrival reads every
replica's load and, for a router that reads them, its KV events, as they stand at that instant.
Applying each replica's decode run up to every arrival, and stepping the step in progress through
the scheduler, costs a full step per replica per arrival. Instead a replica whose run nothing is
released to goes on with it through the arrivals (``simulator.engine._lazy_run``), and the
arrival reads its state from the run: ``PendingRun``.

At an arrival during step ``c`` of a run (steps ``0 .. c - 1`` ended before it, ``c`` was
scheduled and has not ended), the step-by-step reference holds:

- running, the run's requests but those that sampled their last token in steps before ``c``;
  waiting, the requests released to the replica during step ``c`` (the run applies at its end);
- no prompt tokens left but the waiting ones' (the running requests all decode);
- free, the blocks free at the run's start, less one for each decode in steps ``0 .. c`` that
  started a block (taken off the free queue's head: the planner counted only the blocks free at
  the start), plus those the ends freed (a block is freed when the last of its holders ends);
- KV events: an eviction for each block taken that carried a prefix-cache hash; no store, for a
  lazy run is one whose requests register no block while they decode (their own tokens, which
  the cache defers: ``KVCacheManager.registration_stop``), and an end frees without an event.

The evictions reported ahead are struck from the events the run makes when it is applied, so
the router hears each once, in the reference's order.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field

from twinserve.core.block_pool import KVCacheBlock
from twinserve.core.decode_run import DecodeRun
from twinserve.core.kv_cache_manager import KVCacheManager
from twinserve.core.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from twinserve.core.request import Request
from twinserve.routers import ReplicaLoad


def lazy_fits(run: DecodeRun) -> bool:
    """Whether ``run`` may go on through arrivals unapplied: a plain one-group manager (whose
    block starts ``PendingRun`` counts), and no request registering a block as it decodes
    (``LazyFits`` reads only the requests that joined the batch since; this is its reference)."""
    kv = run.scheduler.kv
    decided = _decided_by_manager(kv)
    return decided if decided is not None else _all_fit(run.requests, kv)


def _decided_by_manager(kv: KVCacheManager) -> bool | None:
    """``lazy_fits`` where the manager alone decides it (None: its requests do): False but for
    a plain one-group manager, True without prefix caching, False where it registers a
    request's own blocks as they fill."""
    if type(kv) is not KVCacheManager or kv.sliding_window is not None \
            or kv.key_salt is not None or kv.num_groups != 1:
        return False
    if not kv.enable_caching:
        return True
    return None if kv.defers_own_blocks else False


def _all_fit(requests: Iterable[Request], kv: KVCacheManager) -> bool:
    """Whether none of ``requests`` registers a block as it decodes: ``registration_stop``
    registers nothing more once the first block of its own tokens, ``own_ids_from //
    block_size``, is within the blocks already handled."""
    tables, bs = kv.tables, kv.block_size
    for request in requests:
        own = request.own_ids_from
        if own is None or own // bs > tables[request.request_id].num_cached_blocks:
            return False
    return True


@dataclass(slots=True)
class LazyFits:
    """``lazy_fits`` for one replica's runs, each request checked once: a request that fits
    goes on fitting while it runs, for its blocks handled only grow and its ``own_ids_from`` is
    cleared only when it is preempted (``KVCacheManager.register_own``), which the scheduler
    counts. The running batch keeps its order and requests join it only at its end, counted
    (``Scheduler.num_joined``): so of a run's requests only those that joined since the last
    run found to fit are read, the last ones, without touching the others."""

    _joined: int = -1  # the scheduler's joins at the last run found to fit (-1: read them all)
    _preemptions: int = -1

    def __call__(self, run: DecodeRun) -> bool:
        sched = run.scheduler
        kv = sched.kv
        decided = _decided_by_manager(kv)
        if decided is not None:
            return decided
        if sched.num_preemptions != self._preemptions:
            self._preemptions, self._joined = sched.num_preemptions, -1
        requests, joined = run.requests, sched.num_joined
        new = joined - self._joined  # (at most: some may have left already)
        if self._joined < 0 or new >= len(requests):
            new = len(requests)
        if new and not _all_fit(requests[len(requests) - new:], kv):
            return False
        self._joined = joined
        return True


@dataclass(slots=True)
class PendingRun:
    """A decode run computed ahead and not applied; ``crossing``: the step in progress.

    Counts kept as the crossing step moves on: the blocks taken (a request starts a block in
    the steps ``j`` with ``j % block_size == first``, ``first = -start % block_size``, while it
    decodes, ``j < left``), the requests ended and the blocks their ends freed (a block of theirs
    is freed when the last of its holders ends). The blocks taken are counted step by step from
    the requests decoding per ``first`` (``_live``), each request leaving its count once the
    steps reach its ``left``, in the order of their lefts (``_ended``);
    ``_blocks_taken_plain`` counts the same request by request (the reference)."""

    run: DecodeRun
    crossing: int = 0
    reported: list[int] = field(default_factory=list)  # evictions reported ahead
    _live: list[int] = field(default_factory=list)  # requests per ``first`` still decoding
    _left: int = 0  # ``_ended`` entries whose requests left ``_live``
    _leave_at: int = 0  # the next step at which a request leaves ``_live``
    _upto: int = -1  # the last step counted
    _taken: int = 0  # blocks taken up to it
    _peeked: int = 0  # blocks of the free queue's head read for evictions
    _clean_below: int = -1  # crossings whose evictions are surely none (-1: not yet found)
    _head: list[KVCacheBlock] = field(default_factory=list)  # the queue's head, as far as peeked
    _lefts: list[int] = field(default_factory=list)  # sorted, once a request ends
    _ended: list[int] = field(default_factory=list)  # run indices by left, once one ends
    _num_ended: int = 0  # requests whose ends were counted
    _freed: int = 0
    _holders: dict[KVCacheBlock, int] = field(default_factory=dict)  # refs left of their blocks

    def blocks_taken(self) -> int:
        """The blocks the steps up to the crossing one took when they were scheduled."""
        c = self.crossing
        if c <= self._upto:
            return self._taken
        run = self.run
        bs = run.scheduler.kv.block_size
        live = self._live
        if not live:  # (the first count of this run)
            self._live = live = [0] * bs
            for start in run.starts:
                live[-start % bs] += 1
            self._leave_at = run.stops[0]  # every request decodes before
        taken, leave_at = self._taken, self._leave_at
        for j in range(self._upto + 1, c + 1):
            if j >= leave_at:
                leave_at = self._leave(j)
            taken += live[j % bs]
        self._upto, self._taken, self._leave_at = c, taken, leave_at
        return taken

    def _leave(self, step: int) -> int:
        """Takes the requests whose last decode came before ``step`` out of ``_live``; returns
        the step at which the next one leaves."""
        order, run = self._sorted_by_left(), self.run
        lefts, starts, live, bs = run.lefts, run.starts, self._live, len(self._live)
        k, n = self._left, len(order)
        while k < n and lefts[order[k]] <= step:
            live[-starts[order[k]] % bs] -= 1
            k += 1
        self._left = k
        return lefts[order[k]] if k < n else run.max_steps

    def _sorted_by_left(self) -> list[int]:
        """The run's request indices by ``left`` (stable), made once."""
        if not self._ended:
            run = self.run
            self._ended = sorted(range(len(run.requests)), key=run.lefts.__getitem__)
        return self._ended

    def _blocks_taken_plain(self) -> int:
        """``blocks_taken`` request by request: the steps ``j <= crossing``, ``j < left``, with
        ``j % block_size == first`` (the reference)."""
        run, bs = self.run, self.run.scheduler.kv.block_size
        taken = 0
        for start, left in zip(run.starts, run.lefts):
            first, last = -start % bs, min(self.crossing, left - 1)
            if first <= last:
                taken += (last - first) // bs + 1
        return taken

    def num_ended(self) -> int:
        """The requests that sampled their last token in a step before the crossing one."""
        if self.run.stops[0] > self.crossing:
            return 0
        if not self._lefts:
            self._lefts = sorted(self.run.lefts)
        return bisect_right(self._lefts, self.crossing)

    def blocks_freed(self) -> int:
        """The blocks the ends before the crossing step freed."""
        ended = self.num_ended()
        if ended == self._num_ended:
            return self._freed
        run, order = self.run, self._sorted_by_left()
        tables, bs, holders = run.scheduler.kv.tables, run.scheduler.kv.block_size, self._holders
        for i in order[self._num_ended:ended]:
            for block in tables[run.requests[i].request_id].blocks:
                refs = holders.get(block, block.ref_cnt) - 1
                if refs:
                    holders[block] = refs
                else:
                    holders.pop(block, None)
                    self._freed += 1
            first, last = -run.starts[i] % bs, run.lefts[i] - 1
            if first <= last:  # the blocks it took during the run, its alone
                self._freed += (last - first) // bs + 1
        self._num_ended = ended
        return self._freed

    def refresh(self, load: ReplicaLoad, usage: bool = True) -> None:
        """The replica's load in the crossing step, as the reference holds it, written into
        ``load`` (its step times left to the caller); ``kv_usage`` 0.0 unless ``usage``."""
        sched = self.run.scheduler
        running = len(sched.running)
        ended = self.run.stops[0] <= self.crossing  # some requests ended
        if ended:
            running -= self.num_ended()
        kv_usage = 0.0
        if usage:
            pool = sched.kv.pool
            total = len(pool.blocks)
            free = pool.free_queue.num_free - self.blocks_taken()
            if ended:
                free += self.blocks_freed()
            kv_usage = 1.0 - free / total if total else 0.0
        load.num_running, load.num_waiting, load.kv_usage = running, len(sched.policy), kv_usage
        load.num_prefill_tokens = sched.num_queued_tokens

    def evictions(self) -> list[KVCacheEvent]:
        """The evictions of the blocks taken up to the crossing step not reported yet (as one
        ``BlockRemoved``, the pool's way), remembered in ``reported``. The blocks come off the
        free queue's head in step order; the blocks ends free join its tail.

        A request starts at most one block in every ``block_size`` steps, so where the queue's
        head holds no hash as far as the run's requests could take by the crossing step, there
        is nothing to report, without counting the blocks taken. The queue stays as it is while
        the run is pending, so the crossing steps below which that holds are found once."""
        run, c = self.run, self.crossing
        queue = run.scheduler.kv.pool.free_queue
        if self._clean_below < 0:  # (first read: the steps whose starts cannot reach a hash)
            ahead, bs = queue.unhashed_at_head(), run.scheduler.kv.block_size
            self._clean_below = (run.max_steps if ahead is None
                                 else ahead // len(run.requests) * bs)
        if c < self._clean_below:
            return []
        taken = self._taken if c <= self._upto else self.blocks_taken()
        if taken == self._peeked:
            return []
        if taken > len(self._head):  # (the queue stays as it is while the run is pending:
            # read twice as far as needed, so the arrivals read each block about once)
            self._head = queue.peek(max(2 * taken, 16))
        blocks = self._head[self._peeked:taken]
        hashes = [b.block_hash for b in blocks if b.block_hash is not None]
        self._peeked = taken
        self.reported += hashes
        return [BlockRemoved(hashes)] if hashes else []


def strike(events: list[KVCacheEvent], reported: list[int]) -> list[KVCacheEvent]:
    """``events`` without one eviction of each hash in ``reported`` (reported ahead); as they
    are after a clear (an overflowing buffer's ``AllBlocksCleared``: the reader forgets the
    replica, whatever came before)."""
    if any(isinstance(event, AllBlocksCleared) for event in events):
        return events
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
