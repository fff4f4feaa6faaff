"""Runs of decode-only steps, advanced in one call: the twin's fast path.

Between two events (an arrival, a step that would fail to get a block) a batch that only
decodes repeats the same step: every running request gets one token, the waiting queue stays
empty, nothing is preempted. The scheduler's per-step work is then predictable, so the twin
(``simulator.engine``) advances ``k`` such steps at once instead of calling ``schedule`` and
``update_from_output`` ``k`` times. A request that samples its last token inside the run ends
in that step, as ``update_from_output`` would end it, and the run goes on with the smaller batch:
a run is cut into segments of one batch each (``DecodeRun.stops``)::

    run = plan_decode_run(scheduler, token)        # None unless the next steps are such a run
    for each step the twin's clock allows (at most run.max_steps):
        duration = step_time(run.out)              # the cost model reads the step's aggregates
        run.next_step()                            # aggregates of the step after
        (run.next_segment() at a segment's end)    # its finishing requests leave the batch
    run.apply(ends)                                # the k steps' effects, in the same order

``apply`` makes exactly the calls the step-by-step path would make, in the same order: the
``append_slot`` of each decode that starts a block (at schedule time) and the
``cache_full_blocks`` of each that fills one (at update time), step by step, so block ids,
prefix-cache hashes, evictions and the free count after each step are the same. The per-token work
is one ``extend`` of a request's tokens and the run's array of step times, shared by its batch
(``TokenTimes.adopt``). The plain reference is the
step-by-step loop itself; ``tests/core/test_decode_run.py`` compares the two run for run.

A run that an arrival interrupts closes with the step that admits the arrival beside its
decodes (``open_closing``, ``Scheduler.schedule_beside_run``, ``close``): the decodes of that
step join the run, so its running requests are touched once for the run and that step together,
where a full ``schedule`` and ``update_from_output`` would touch each of them twice more.

The real engine never uses this: its tokens come from the model, one step at a time.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate, repeat

from twinserve.core.block_hash import update_block_hashes
from twinserve.core.block_pool import KVCacheBlock
from twinserve.core.kv_cache_manager import BlockTable, KVCacheManager
from twinserve.core.outputs import ScheduledRequest, SchedulerOutput
from twinserve.core.request import Request, RequestStatus
from twinserve.core.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING


@dataclass(slots=True)
class DecodeRun:
    """The next steps of ``scheduler``, all decode-only. ``out`` holds the aggregates of the step
    about to be timed (the cost model's input; its entries are the decodes of that step).

    The run is cut into segments at the steps where requests sample their last token
    (``stops``): a segment's steps have one batch; at its end its finishing requests leave.
    Without multi-segment runs (a policy that accounts tokens, a layout whose block events take
    the per-event order) the one segment ends at the first finish."""

    scheduler: Scheduler
    token: int
    max_steps: int
    out: SchedulerOutput
    requests: list[Request]  # the running requests at the run's start, in order
    starts: list[int]  # each one's num_computed_tokens before the run
    lefts: list[int]  # each running request's steps up to and including its last token's
    stops: list[int]  # the segments' last steps (ascending; the last is ``max_steps``)
    taken: int = 0  # steps ``out`` was moved past
    segment: int = 0  # ``stops`` index of the current segment
    finished: list[Request] = field(default_factory=list)  # ended by ``apply``, in order
    # A closing run's (``open_closing``) steps per request and finishing indices per step
    closing: tuple[list[int], list[list[int]]] | None = None

    def next_step(self) -> None:
        """Moves ``out`` to the following step of its segment: every context one token longer."""
        out, n = self.out, self.out.num_decode_seqs
        out.sum_context_tokens += n
        out.sum_decode_context_tokens += n
        out.max_decode_context += 1
        self.taken += 1

    def next_steps(self, k: int) -> None:
        """``next_step`` ``k`` times."""
        out, n = self.out, self.out.num_decode_seqs
        out.sum_context_tokens += n * k
        out.sum_decode_context_tokens += n * k
        out.max_decode_context += k
        self.taken += k

    def segment_steps(self) -> int:
        """The steps left in the current segment (``out``'s batch)."""
        return self.stops[self.segment] - self.taken

    def next_segment(self) -> None:
        """Moves ``out`` from the end of its segment to the next one's first step: the requests
        whose last token the segment sampled leave the batch."""
        step = self.taken
        if step != self.stops[self.segment] or step >= self.max_steps:
            raise ValueError(f"a decode run at step {step} is not at the end of a segment.")
        self.segment += 1
        running, starts = self.requests, self.starts
        keep = [i for i, left in enumerate(self.lefts) if left > step]
        out, n = self.out, len(keep)
        out.scheduled = [running[i].decode_entry for i in keep]  # type: ignore[misc]
        out.total_num_scheduled_tokens = out.num_decode_tokens = out.num_decode_seqs = n
        out.sum_context_tokens = out.sum_decode_context_tokens = \
            sum(starts[i] for i in keep) + n * (step + 1)
        out.max_decode_context = max(starts[i] for i in keep) + step + 1

    def segments(self, k: int) -> list[tuple[int, int, list[Request], int]]:
        """The segments of the first ``k`` steps: (first step, end step (exclusive, 0-based),
        the requests decoding in them, how many of those end at its last step)."""
        running, lefts = self.requests, self.lefts
        out, first = [], 0
        for stop in self.stops:
            end = min(stop, k)
            active = running if not first else [  # (every request takes the first step)
                r for r, left in zip(running, lefts) if left > first]
            out.append((first, end, active, lefts.count(end) if end == stop else 0))
            if end == k:
                break
            first = end
        return out

    def apply(self, ends: list[float]) -> list[int]:
        """Applies ``len(ends)`` steps (``ends``: their end times), as ``schedule`` and
        ``update_from_output`` would have, one step after the other, ending each request in the
        step that samples its last token (``finished``). Returns the free device blocks after
        each step (its step row's KV usage)."""
        k = len(ends)
        if not 0 < k <= self.max_steps:
            raise ValueError(f"a decode run of {self.max_steps} steps cannot apply {k}.")
        sched = self.scheduler
        sched.drop_finished_ids()  # what the run's first step would have handed the backend
        running, lefts = self.requests, self.lefts
        limits: list[int] = []  # the steps each request takes part in
        ending: list[list[int]] = [[] for _ in range(k)]  # each step's requests ending in it
        tokens, times = [self.token] * k, array("d", ends)
        for i, (request, left) in enumerate(zip(running, lefts)):
            if left < k:
                request.output_token_ids.extend(tokens[:left])
                request.all_token_ids.extend(tokens[:left])
                request.token_times.adopt(times[:left])
                ending[left - 1].append(i)
                limits.append(left)
            else:
                request.output_token_ids.extend(tokens)
                request.all_token_ids.extend(tokens)
                request.token_times.adopt(times)
                if left == k:
                    ending[-1].append(i)
                limits.append(k)
        on_tokens = sched.policy.on_output_tokens if sched.policy.accounts_tokens else None
        free_after = self._block_events_at_once(k, limits)
        # in the per-event order the finishes are events too, unless the policy must first
        # hear the tokens (such a run has one segment: its finishes come after everything)
        ended_in_order = free_after is None and on_tokens is None
        if free_after is None:
            free_after = self._block_events(k, limits, ending if ended_in_order else
                                            [[] for _ in range(k)], ends)
        self._set_progress(limits)
        if on_tokens is not None:  # one token at a time: the policy's float sums stay the same
            for _ in range(k):  # (such a run has one segment: every request in every step)
                for request in running:
                    on_tokens(request, 1)
        sched.num_generation_tokens += sum(limits)
        if not ended_in_order:
            self._end_requests(ending, ends, free_after)
        self.finished = [running[i] for step in ending for i in step]
        return free_after

    def open_closing(self, ends: list[float]) -> list[int] | None:
        """The first half of a run whose last step also admits prompts (the run's closing step,
        ``Scheduler.schedule_beside_run``), ``ends`` being the steps before it: the block events
        of every step, at once, and the finishes of the steps before the last. Returns the free
        blocks after each of those steps, or None (nothing done) where ``apply`` alone fits:
        the per-event order, a policy that hears each token, or a block the run would register
        in the prefix cache (an admission could look it up before its registration's turn).

        The admission comes after every block the run takes (the step-by-step order: the
        closing step's decodes take theirs before its waiting requests) and after the finishes
        of the earlier steps (their blocks are free by then), so only registrations move past
        it: there are none. The tokens wait for ``close``, which knows the last step's end."""
        k = len(ends) + 1
        if not 1 < k <= self.max_steps:
            raise ValueError(f"a decode run of {self.max_steps} steps cannot close at step {k}.")
        sched = self.scheduler
        if sched.policy.accounts_tokens:
            return None
        limits = [left if left < k else k for left in self.lefts]
        free_after = self._block_events_at_once(k, limits, register=False)
        if free_after is None:
            return None
        sched.drop_finished_ids()
        ending: list[list[int]] = [[] for _ in range(k)]
        for i, n in enumerate(limits):
            if n == self.lefts[i]:
                ending[n - 1].append(i)
        self.closing = (limits, ending)
        del free_after[-1]  # the closing step's row is the scheduler's own (``record_step``)
        self._end_requests(ending[:-1], ends, free_after)
        return free_after

    def close(self, ends: list[float]) -> None:
        """The second half of a closing run (``open_closing``): every step's tokens (``ends``:
        their end times, the closing step's last), the requests' progress and entries, and the
        finishes of the closing step, which come before its prompts' updates."""
        if self.closing is None or len(ends) != len(self.closing[1]):
            raise ValueError("close() needs open_closing() of the steps before the last.")
        limits, ending = self.closing
        self.closing = None
        k = len(ends)
        tokens, times = [self.token] * k, array("d", ends)
        for request, n in zip(self.requests, limits):
            if n < k:
                request.output_token_ids.extend(tokens[:n])
                request.all_token_ids.extend(tokens[:n])
                request.token_times.adopt(times[:n])
            else:
                request.output_token_ids.extend(tokens)
                request.all_token_ids.extend(tokens)
                request.token_times.adopt(times)
        self._set_progress(limits)
        sched = self.scheduler
        sched.num_generation_tokens += sum(limits)
        running = self.requests
        if ending[-1]:
            sched.finish_at_length([running[i] for i in ending[-1]], ends[-1])
        self.finished = [running[i] for step in ending for i in step]

    def _set_progress(self, limits: list[int]) -> None:
        """Each request's computed tokens after its ``limits[i]`` steps, and the start of the
        next step in the entry of each that goes on decoding. (The entry's block ids are its
        table's own lists, which the run's blocks joined in place.)"""
        for request, start, n, left in zip(self.requests, self.starts, limits, self.lefts):
            request.num_computed_tokens = start + n
            if n < left:
                request.decode_entry.start = start + n - 1  # type: ignore[union-attr]

    def _end_requests(self, ending: list[list[int]], ends: list[float],
                      free_after: list[int]) -> None:
        """Ends each step's finishing requests after the run's block events were made at once
        (their blocks join the free queue's tail, which no block of the run came from), adding
        the blocks they free to the free counts from that step on."""
        sched = self.scheduler
        running, queue, k = self.requests, sched.kv.pool.free_queue, len(ends)
        freed = 0
        for j, step in enumerate(ending):
            if step:
                before = queue.num_free
                sched.finish_at_length([running[i] for i in step], ends[j])
                freed += queue.num_free - before
                if j < k - 1:
                    sched.drop_finished_ids()  # handed out by the step after
            free_after[j] += freed

    def _block_events_at_once(self, k: int, limits: list[int],
                              register: bool = True) -> list[int] | None:
        """``_block_events`` of ``k`` steps (request ``i`` in the first ``limits[i]``) with
        every new block of the run taken in one ``allocate`` and every newly full block of a
        request hashed and cached in one call, for a one-group manager without a sliding window
        (else None, changing nothing: the caller runs ``_block_events``).

        Only finishes free blocks inside a run, to the free queue's tail, after every block the
        run takes came off its head (the planner counted only the blocks free at its start), so
        the blocks come off the head in the same order either way: the step-by-step order,
        (step, running index), hands them out. Taking them all first moves each eviction (the
        cached hash of a block handed out) before the cache registrations of the steps before
        it; registering a request's blocks together reorders registrations across requests.
        Neither changes the outcome unless a new block's hash is already cached or two new
        blocks share one (equal prefixes decoding together): then None, after the allocation
        is checked but before anything is done. A request whose table is not exactly its
        computed tokens' blocks also takes the reference path (each of its block starts must
        take one block). ``register`` False: None too where a block would be registered."""
        sched = self.scheduler
        kv = sched.kv
        if type(kv) is not KVCacheManager or kv.sliding_window is not None \
                or kv.key_salt is not None:
            return None
        bs, caching, tables = kv.block_size, kv.enable_caching, kv.tables
        allocs: list[tuple[int, int]] = []  # (step, running index) of each block start
        growing: dict[int, BlockTable] = {}  # running index -> its table, where blocks start
        # (table, first new full block, where registering stops, full blocks after the run)
        new_full: list[tuple[BlockTable, int, int, int]] = []
        new_hashes: list[int] = []
        for i, (request, start, n) in enumerate(zip(self.requests, self.starts, limits)):
            first = (-start) % bs  # the first step whose decode starts a block
            # (a block fills in the step before each start: ``(first or bs) - 1 < n``)
            fills = caching and (first or bs) <= n
            if first >= n and not fills:
                continue
            table = tables[request.request_id]
            if first < n:
                if len(table.blocks) != -(-start // bs):
                    return None
                growing[i] = table
                allocs += zip(range(first, n, bs), repeat(i))
            if fills:
                num_cached, num_full = table.num_cached_blocks, (start + n) // bs
                if num_full > num_cached:
                    stop = kv.registration_stop(request, num_cached, num_full)
                    dropped = table.num_dropped
                    first_new = num_cached if num_cached >= dropped else dropped
                    if first_new < stop:
                        if not register:
                            return None
                        new_hashes += update_block_hashes(request, bs, stop * bs)[first_new:stop]
                    new_full.append((table, first_new, stop, num_full))
        # (registrations here record no KV events: with a router reading them, the reference)
        if new_hashes and (kv.pool.events is not None or len(set(new_hashes)) != len(new_hashes)
                           or not kv.pool.cached.keys().isdisjoint(new_hashes)):
            return None
        pool = kv.pool
        free0 = pool.free_queue.num_free
        if len(allocs) > free0:
            raise RuntimeError("decode run: fewer free blocks than block starts "
                               "(plan_decode_run counted the free blocks)")
        if not allocs:
            free_after = [free0] * k
        else:
            per_step = [0] * k
            allocs.sort()
            got: dict[int, list[KVCacheBlock]] = {}
            for (j, i), block in zip(allocs, pool.allocate(len(allocs))):
                per_step[j] += 1
                mine = got.get(i)
                if mine is None:
                    got[i] = [block]
                else:
                    mine.append(block)
            for i, mine in got.items():
                growing[i].append(mine)
            free_after = [free0 - taken for taken in accumulate(per_step)]
        if new_full:
            cached = pool.cached
            hashes = iter(new_hashes)
            for table, first_new, stop, num_full in new_full:
                for block in table.blocks[first_new:stop]:
                    h = next(hashes)
                    if block.block_hash is None:  # (never cached before: the reference's
                        block.block_hash = h      # first-writer test, ``h`` being new)
                        cached[h] = block
                table.num_cached_blocks = num_full
        return free_after

    def _block_events(self, k: int, limits: list[int], ending: list[list[int]],
                      ends: list[float]) -> list[int]:
        """The block-table calls of ``k`` steps (request ``i`` in the first ``limits[i]``) in
        the order the step-by-step path makes them: step by step, a step's new blocks (running
        order), then its newly full blocks, then its finishing requests (``ending``) end.
        Returns the free blocks after each step (the reference of ``_block_events_at_once``)."""
        sched = self.scheduler
        kv, bs = sched.kv, sched.kv.block_size
        caching = sched.kv.enable_caching
        events: list[tuple[int, int, int]] = []
        for i, start in enumerate(self.starts):
            events.extend((j, 0, i) for j in range((-start) % bs, limits[i], bs))
            if caching:
                events.extend((j, 1, i) for j in range((-start - 1) % bs, limits[i], bs))
        events.extend((j, 2, i) for j, step in enumerate(ending) for i in step)
        free_queue = kv.pool.free_queue
        events.sort()
        events.append((k, 0, 0))  # a sentinel past the last step
        running, starts = self.requests, self.starts
        free_after: list[int] = []
        e = 0
        for step in range(k):
            j, phase, i = events[e]
            while j == step:
                request = running[i]
                if phase == 0:
                    request.num_computed_tokens = starts[i] + j
                    if kv.append_slot(request) is None:
                        raise RuntimeError(f"decode run: no block for {request.request_id!r} "
                                           "(plan_decode_run counted the free blocks)")
                elif phase == 1:
                    request.num_computed_tokens = starts[i] + j + 1
                    kv.cache_full_blocks(request)
                else:
                    sched.finish_at_length([request], ends[j])
                e += 1
                j, phase, i = events[e]
            if ending[step] and step < k - 1:
                sched.drop_finished_ids()  # handed out by the step after
            free_after.append(free_queue.num_free)
        return free_after


def plan_decode_run(sched: Scheduler, token: int) -> DecodeRun | None:
    """The run of decode-only steps ``sched`` would schedule next, each request sampling
    ``token``, through the step where its last request samples its last token (one where the
    first does, with a policy that accounts tokens or a layout that needs the per-event order)
    or the last step the free blocks cover; None where the next step is not such a step.
    Ineligible: waiting requests, LoRA, n > 1 samples, policies that watch the clock, pending
    block copies, a budget below the batch, a request whose stop ids hold ``token``."""
    running, kv = sched.running, sched.kv
    n, bs = len(running), kv.block_size
    if (not n or len(sched.policy) or sched.loras is not None or not sched.is_plain_decoding
            or kv.block_ops is not None or n > sched.config.max_num_batched_tokens):
        return None
    starts: list[int] = []
    lefts: list[int] = []
    for request in running:
        # (its tokens are its prompt and its outputs: one length read, where the twin's
        # requests answer ``len`` in Python)
        start, num_prompt = request.num_computed_tokens, request.num_prompt_tokens
        num_out = len(request.output_token_ids)
        if (request.status != _RUNNING or num_prompt + num_out - start != 1
                or start < num_prompt or token in request.stop_ids
                or (request.decode_entry is None and not start % bs)):
            return None  # (a first decode that starts a block takes the step's own path)
        starts.append(start)
        lefts.append(request.max_output_tokens - num_out)
    segmented = (not sched.policy.accounts_tokens and type(kv) is KVCacheManager
                 and kv.sliding_window is None and kv.key_salt is None)
    max_steps = _steps_with_blocks(sched, starts, lefts, max(lefts) if segmented
                                   else min(lefts))
    if max_steps <= 0:
        return None
    for request, start in zip(running, starts):
        if request.decode_entry is None:  # its first decode: the entry that step would make
            # (its slot lies in its last block: the step would have read the table as it is)
            table = kv.tables[request.request_id]
            request.decode_entry = ScheduledRequest(request, start, 1, table.ids, True,
                                                    table.group_ids)
    out = SchedulerOutput()
    out.scheduled = [r.decode_entry for r in running]  # type: ignore[misc]
    out.total_num_scheduled_tokens = out.num_decode_tokens = out.num_decode_seqs = n
    out.sum_context_tokens = out.sum_decode_context_tokens = sum(starts) + n
    out.max_decode_context = max(starts) + 1
    distinct = sorted(set(lefts))
    stops = distinct[:bisect_left(distinct, max_steps)]
    stops.append(max_steps)
    return DecodeRun(sched, token, max_steps, out, list(running), starts, lefts, stops)


def _steps_with_blocks(sched: Scheduler, starts: list[int], lefts: list[int],
                       max_steps: int) -> int:
    """The most of ``max_steps`` steps whose new blocks the blocks free now cover (counting one
    per decode that starts a block, in the steps up to its request's last token, and KV cache
    group; the blocks a finish or a sliding window frees only add to that)."""
    kv = sched.kv
    free, bs = kv.pool.free_queue.num_free // kv.num_groups, kv.block_size
    if len(starts) * (max_steps // bs + 1) <= free:
        return max_steps
    firsts = [(-start) % bs for start in starts]
    ends = [left if left < max_steps else max_steps for left in lefts]
    step = kth_block_start(firsts, ends, bs, free)
    return max_steps if step is None else step


def kth_block_start(firsts: list[int], ends: list[int], bs: int, k: int) -> int | None:
    """The ``k``-th (from 0) of the steps at which the requests start blocks, in order: request
    ``i`` starts one at ``firsts[i]``, then every ``bs`` steps, below ``ends[i]``; None where
    they start ``k`` or fewer. Steps ``[r * bs, (r + 1) * bs)`` hold one start of every request
    with more than ``r`` starts, at ``r * bs + firsts[i]``, so the counts (sorted) find the
    round holding the ``k``-th and its requests' firsts (sorted) the step within it, without
    listing every start (``_kth_block_start_plain`` sorts them all: the reference)."""
    counts = sorted(len(range(f, e, bs)) for f, e in zip(firsts, ends))
    n, before, r = len(counts), 0, 0  # starts in the rounds before round r
    for i, count in enumerate(counts):  # rounds r .. count - 1: n - i requests in each
        if count > r:
            width = n - i
            if before + (count - r) * width > k:
                rounds = (k - before) // width
                r, before = r + rounds, before + rounds * width
                active = sorted(f for f, e in zip(firsts, ends) if len(range(f, e, bs)) > r)
                return r * bs + active[k - before]
            before, r = before + (count - r) * width, count
    return None


def _kth_block_start_plain(firsts: list[int], ends: list[int], bs: int, k: int) -> int | None:
    """``kth_block_start`` by sorting every start (the reference)."""
    steps = sorted(j for f, e in zip(firsts, ends) for j in range(f, e, bs))
    return steps[k] if k < len(steps) else None
