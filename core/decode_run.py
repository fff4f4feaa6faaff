"""Runs of decode-only steps, advanced in one call: the twin's fast path.

Between two events (an arrival, a finish, a step that would fail to get a block) a batch that only
decodes repeats the same step: every running request gets one token, the waiting queue stays
empty, nothing is preempted. The scheduler's per-step work is then predictable, so the twin
(``simulator.engine``) advances ``k`` such steps at once instead of calling ``schedule`` and
``update_from_output`` ``k`` times. A run's last step may be the one where its first requests
sample their last token (``DecodeRun.finishing``): they end there, as ``update_from_output``
would end them, and the next run starts from the smaller batch::

    run = plan_decode_run(scheduler, token)        # None unless the next steps are such a run
    for each step the twin's clock allows (at most run.max_steps):
        duration = step_time(run.out)              # the cost model reads the step's aggregates
        run.next_step()                            # aggregates of the step after
    run.apply(ends)                                # the k steps' effects, in the same order

``apply`` makes exactly the calls the step-by-step path would make, in the same order: the
``append_slot`` of each decode that starts a block (at schedule time) and the
``cache_full_blocks`` of each that fills one (at update time), step by step, so block ids,
prefix-cache hashes, evictions and the free count after each step are the same. The per-token work
(appending the token and its time) is one ``extend`` per request. The plain reference is the
step-by-step loop itself; ``tests/test_decode_run.py`` compares the two run for run.

The real engine never uses this: its tokens come from the model, one step at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from twinserve.core.block_hash import update_block_hashes
from twinserve.core.kv_cache_manager import KVCacheManager
from twinserve.core.outputs import ScheduledRequest, SchedulerOutput
from twinserve.core.request import Request, RequestStatus
from twinserve.core.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING


@dataclass(slots=True)
class DecodeRun:
    """The next steps of ``scheduler``, all decode-only. ``out`` holds the aggregates of the step
    about to be timed (the cost model's input; its entries are the running decodes)."""

    scheduler: Scheduler
    token: int
    max_steps: int
    out: SchedulerOutput
    starts: list[int]  # each running request's num_computed_tokens before the run
    # the requests whose last token step ``max_steps`` samples (none when the free blocks end
    # the run first); they finish when the run is applied in full
    finishing: list[Request]

    def next_step(self) -> None:
        """Moves ``out`` to the following step: every context one token longer."""
        out, n = self.out, self.out.num_decode_seqs
        out.sum_context_tokens += n
        out.sum_decode_context_tokens += n
        out.max_decode_context += 1

    def next_steps(self, k: int) -> None:
        """``next_step`` ``k`` times."""
        out, n = self.out, self.out.num_decode_seqs
        out.sum_context_tokens += n * k
        out.sum_decode_context_tokens += n * k
        out.max_decode_context += k

    def apply(self, ends: list[float]) -> list[int]:
        """Applies ``len(ends)`` steps (``ends``: their end times), as ``schedule`` and
        ``update_from_output`` would have, one step after the other, ending the ``finishing``
        requests when the last step is the run's last (``finished`` says which ended). Returns
        the free device blocks after each step (its step row's KV usage)."""
        k = len(ends)
        if not 0 < k <= self.max_steps:
            raise ValueError(f"a decode run of {self.max_steps} steps cannot apply {k}.")
        sched = self.scheduler
        running, starts, token = sched.running, self.starts, self.token
        tokens = [token] * k
        for request in running:
            request.output_token_ids += tokens
            request.all_token_ids.extend(tokens)
            request.token_times += ends
        free_after = self._block_events_at_once(k)
        if free_after is None:
            free_after = self._block_events(k)
        tables = sched.kv.tables
        for request, start in zip(running, starts):
            request.num_computed_tokens = start + k
            entry, table = request.decode_entry, tables[request.request_id]
            entry.start = start + k - 1  # type: ignore[union-attr]
            entry.block_ids, entry.group_block_ids = table.ids, table.group_ids  # type: ignore[union-attr]
        on_tokens = sched.policy.on_output_tokens if sched.policy.accounts_tokens else None
        if on_tokens is not None:  # one token at a time: the policy's float sums stay the same
            for _ in range(k):
                for request in running:
                    on_tokens(request, 1)
        sched.num_generation_tokens += k * len(running)
        sched.drop_finished_ids()  # what the run's first step would have handed the backend
        if k == self.max_steps and self.finishing:
            sched.finish_at_length(self.finishing, ends[-1])
            free_after[-1] = sched.kv.pool.free_queue.num_free
        return free_after

    @property
    def finished(self) -> list[Request]:
        """The requests that ended in the steps applied (after ``apply``)."""
        return [r for r in self.finishing if r.status != _RUNNING]

    def _block_events_at_once(self, k: int) -> list[int] | None:
        """``_block_events(k)`` with every new block of the run taken in one ``allocate`` and
        every newly full block of a request hashed and cached in one call, for a one-group
        manager without a sliding window (else None, changing nothing: the caller runs
        ``_block_events``).

        Nothing is freed inside a run, so the blocks come off the free queue's head in the same
        order either way: the step-by-step order, (step, running index), hands them out. Taking
        them all first moves each eviction (the cached hash of a block handed out) before the
        cache registrations of the steps before it; registering a request's blocks together
        reorders registrations across requests. Neither changes the outcome unless a new
        block's hash is already cached or two new blocks share one (equal prefixes decoding
        together): then None, after the allocation is checked but before anything is done. A
        request whose table is not exactly its computed tokens' blocks also takes the
        reference path (each of its block starts must take one block)."""
        sched = self.scheduler
        kv = sched.kv
        if type(kv) is not KVCacheManager or kv.sliding_window is not None \
                or kv.key_salt is not None:
            return None
        bs, starts, running = kv.block_size, self.starts, sched.running
        tables = kv.tables
        allocs: list[tuple[int, int]] = []  # (step, running index) of each block start
        for i, start in enumerate(starts):
            first = (-start) % bs
            if first < k:
                if len(tables[running[i].request_id].blocks) != -(-start // bs):
                    return None
                allocs.extend((j, i) for j in range(first, k, bs))
        caching = kv.enable_caching
        new_full: list[tuple[int, int]] = []  # (running index, first new full block)
        new_hashes: list[int] = []
        if caching:
            for i, start in enumerate(starts):
                if (-start - 1) % bs < k:  # a block fills within the run
                    request = running[i]
                    table = tables[request.request_id]
                    num_full = (start + k) // bs
                    first_new = max(table.num_cached_blocks, table.num_dropped)
                    if num_full > table.num_cached_blocks:
                        new_hashes += update_block_hashes(request, bs, num_full * bs)[
                            first_new:num_full]
                        new_full.append((i, first_new))
            if new_hashes and (len(set(new_hashes)) != len(new_hashes)
                               or not kv.pool.cached.keys().isdisjoint(new_hashes)):
                return None
        pool = kv.pool
        free0 = pool.free_queue.num_free
        if len(allocs) > free0:
            raise RuntimeError("decode run: fewer free blocks than block starts "
                               "(plan_decode_run counted the free blocks)")
        per_step = [0] * k
        if allocs:
            allocs.sort()
            blocks = iter(pool.allocate(len(allocs)))
            got: dict[int, list] = {}
            for j, i in allocs:
                per_step[j] += 1
                mine = got.get(i)
                if mine is None:
                    got[i] = [next(blocks)]
                else:
                    mine.append(next(blocks))
            for i, mine in got.items():
                tables[running[i].request_id].append(mine)
        if new_full:
            cached = pool.cached
            hashes = iter(new_hashes)
            for i, first_new in new_full:
                request = running[i]
                table = tables[request.request_id]
                num_full = (starts[i] + k) // bs
                for block in table.blocks[first_new:num_full]:
                    h = next(hashes)
                    if block.block_hash is None:  # (never cached before: the reference's
                        block.block_hash = h      # first-writer test, ``h`` being new)
                        cached[h] = block
                table.num_cached_blocks = num_full
        return [free0 - taken for taken in accumulate(per_step)]

    def _block_events(self, k: int) -> list[int]:
        """The block-table calls of ``k`` steps in the order the step-by-step path makes them:
        step by step, a step's new blocks (running order) before its newly full blocks. Returns
        the free blocks after each step (the reference of ``_block_events_at_once``)."""
        sched = self.scheduler
        kv, bs = sched.kv, sched.kv.block_size
        caching = sched.kv.enable_caching
        events: list[tuple[int, int, int]] = []
        for i, start in enumerate(self.starts):
            events.extend((j, 0, i) for j in range((-start) % bs, k, bs))
            if caching:
                events.extend((j, 1, i) for j in range((-start - 1) % bs, k, bs))
        free_queue = kv.pool.free_queue
        if not events:
            return [free_queue.num_free] * k
        events.sort()
        events.append((k, 0, 0))  # a sentinel past the last step
        running, starts = sched.running, self.starts
        free_after: list[int] = []
        e = 0
        for step in range(k):
            j, phase, i = events[e]
            while j == step:
                request = running[i]
                request.num_computed_tokens = starts[i] + j + phase
                if phase == 0:
                    if kv.append_slot(request) is None:
                        raise RuntimeError(f"decode run: no block for {request.request_id!r} "
                                           "(plan_decode_run counted the free blocks)")
                else:
                    kv.cache_full_blocks(request)
                e += 1
                j, phase, i = events[e]
            free_after.append(free_queue.num_free)
        return free_after


def plan_decode_run(sched: Scheduler, token: int) -> DecodeRun | None:
    """The run of decode-only steps ``sched`` would schedule next, each request sampling
    ``token``, up to the step where the first requests sample their last token (or the last
    step the free blocks cover); None where the next step is not such a step. Ineligible:
    waiting requests, LoRA, n > 1 samples, policies that watch the clock, pending block copies,
    a budget below the batch, a request whose stop ids hold ``token``."""
    running, bs = sched.running, sched.kv.block_size
    n = len(running)
    if (not n or len(sched.policy) or sched.loras is not None or not sched.is_plain_decoding
            or sched.kv.block_ops is not None or n > sched.config.max_num_batched_tokens):
        return None
    max_steps = 1 << 62
    starts: list[int] = []
    for request in running:
        start = request.num_computed_tokens
        if (request.status != _RUNNING or len(request.all_token_ids) - start != 1
                or start < request.num_prompt_tokens or token in request.stop_ids
                or (request.decode_entry is None and not start % bs)):
            return None  # (a first decode that starts a block takes the step's own path)
        left = request.max_output_tokens - len(request.output_token_ids)  # its steps to go
        if left < max_steps:
            max_steps = left
        starts.append(start)
    if max_steps <= 0:
        return None
    last = max_steps
    max_steps = _steps_with_blocks(sched, starts, max_steps)
    if max_steps <= 0:
        return None
    finishing = [] if max_steps < last else [
        r for r in running if r.max_output_tokens - len(r.output_token_ids) == last]
    for request, start in zip(running, starts):
        if request.decode_entry is None:  # its first decode: the entry that step would make
            # (its slot lies in its last block: the step would have read the table as it is)
            table = sched.kv.tables[request.request_id]
            request.decode_entry = ScheduledRequest(request, start, 1, table.ids, True,
                                                    table.group_ids)
    out = SchedulerOutput()
    out.scheduled = [r.decode_entry for r in running]  # type: ignore[misc]
    out.total_num_scheduled_tokens = out.num_decode_tokens = out.num_decode_seqs = n
    out.sum_context_tokens = out.sum_decode_context_tokens = sum(starts) + n
    out.max_decode_context = max(starts) + 1
    return DecodeRun(sched, token, max_steps, out, starts, finishing)


def _steps_with_blocks(sched: Scheduler, starts: list[int], max_steps: int) -> int:
    """The most of ``max_steps`` steps whose new blocks the free blocks cover (counting one per
    decode that starts a block and KV cache group; a sliding window's freed blocks only add to
    that)."""
    kv = sched.kv
    free, bs = kv.pool.free_queue.num_free // kv.num_groups, kv.block_size
    if len(starts) * (max_steps // bs + 1) <= free:
        return max_steps
    steps = sorted(j for start in starts for j in range((-start) % bs, max_steps, bs))
    return max_steps if len(steps) <= free else steps[free]
