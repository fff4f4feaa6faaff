"""The token-budget scheduler shared by the real engine and the simulator.

No prefill or decode phases: each step hands out tokens so that every scheduled request's
``num_computed_tokens`` catches up with its ``num_tokens``, within ``max_num_batched_tokens`` and
``max_num_seqs``. Chunked prefill, prefix caching and continuous batching fall out of that loop::

    schedule(now)
      1. running, in admission order            2. waiting, in the policy's order
         +--------------------------------+        (only if nobody was preempted this step)
         | want = num_tokens - computed   |        +----------------------------------------+
         | clip to budget / threshold     |        | swapped? swap its blocks back in       |
         | allocate_slots(want)           |        | else adopt prefix-cache hits           |
         |   None -> preempt policy victim|        | allocate_slots(rest of chunk)          |
         |           among running[i:],   |        |   None -> policy may preempt a running |
         |           retry (or stop if the|        |           victim it outranks, or stop  |
         |           victim is this one)  |        | move to running                        |
         +--------------------------------+        +----------------------------------------+
    update_from_output(out, tokens, now)
      advance num_computed_tokens, cache full blocks, append sampled tokens, stop checks,
      fork n > 1 children after the first token, free the blocks of finished requests.

Speculative decoding (``num_speculative_tokens`` > 0, a ``SpeculationPolicy``): a running decode
verifies its drafts in its own entry and rolls back the rejected ones
(``core.scheduler_speculation``). A KV connector (``core.kv_connector``, None without one): a
request whose prompt is loaded from outside waits in ``waiting_for_remote`` without a seat, and a
producer's finished request keeps its blocks in ``sending`` until read
(``core.scheduler_kv_connector``). Both are parts of ``Scheduler`` kept in their own files.

``schedule`` and ``update_from_output`` are pure CPU work over plain data; time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twinserve.core.config import SchedulerConfig
from twinserve.core.errors import EngineOverloaded
from twinserve.core.kv_cache_coordinator import make_kv_cache_manager
from twinserve.core.kv_cache_manager import BlockTable
from twinserve.core.kv_connector import KVConnectorScheduler, check_kv_transfer_params
from twinserve.core.kv_events import KVCacheEvent, KVEventBuffer
from twinserve.core.lora import LoRASlots
from twinserve.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    attach_prompt_results,
)
from twinserve.core.policy import SchedulingPolicy
from twinserve.core.request import Request, RequestStatus
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler_kv_connector import KVConnectorSteps, RemoteLoad
from twinserve.core.scheduler_speculation import SpeculationSteps
from twinserve.core.speculation import SpeculationPolicy

# Enum class attributes cost ~0.1 us a lookup on Python 3.11: the hot paths read these instead.
_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_LAST_UNFINISHED = RequestStatus.WAITING_FOR_REMOTE_KVS
_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_NEVER = 1 << 62  # a modulus above any token count
ADMISSION_RETRY_AFTER_S = 1.0  # what an overloaded engine suggests to a client (Retry-After)


def child_request_id(parent_id: str, index: int) -> str:
    """Id of the ``index``-th sample of an n > 1 request (index 0 is the parent itself)."""
    return parent_id if index == 0 else f"{parent_id}#{index}"


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    # Speculative decoding, vLLM's names: verifications, drafts verified, drafts accepted (and
    # per draft position, k_max of them).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] | None = None
    num_prefill_tokens: int = 0  # prompt tokens not yet computed (``Scheduler.num_prefill_tokens``)
    # A connector's hits (the host KV tier), vLLM's external prefix cache counters, in tokens.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0


class Scheduler(SpeculationSteps, KVConnectorSteps):
    def __init__(self, config: SchedulerConfig, policy: SchedulingPolicy,
                 stream_outputs: bool = True, speculation: SpeculationPolicy | None = None,
                 kv_connector: KVConnectorScheduler | None = None) -> None:
        if config.num_speculative_tokens and speculation is None:
            raise ValueError("num_speculative_tokens > 0 needs a speculation policy "
                             "(policies.speculation.get_speculation_policy).")
        self.config = config
        self.policy = policy
        self.stream_outputs = stream_outputs
        self.kv = make_kv_cache_manager(config.num_gpu_blocks, config.block_size,
                                        config.enable_prefix_caching, config.num_cpu_blocks,
                                        config.sliding_window, config.kv_cache_group_windows)
        if config.kv_events:
            self.kv.pool.events = KVEventBuffer()
        self.requests: dict[str, Request] = {}
        # Requests join ``running`` only at its end (an admission, a forked sample) and leave it
        # from anywhere: it keeps its order. ``num_joined`` counts the joins.
        self.running: list[Request] = []
        self.num_joined = 0
        # The running requests that may have prompt tokens left: each joins it with ``running``
        # and leaves it when ``num_prefill_tokens`` finds it done or no longer running.
        self._prefilling: set[Request] = set()
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._multi_sample = False  # any n > 1 request seen: seat reservations apply
        # Read by update_from_output every step. A crossed block boundary is
        # ``num_computed % cache_every < n``; without caching the modulus exceeds every token
        # count, so the test never holds (one compare per request).
        self._cache_every = config.block_size if config.enable_prefix_caching else _NEVER
        self._on_tokens = policy.on_output_tokens if policy.accounts_tokens else None
        # Requests (and their prompt tokens) queued and never admitted: the admission bounds.
        self.num_queued = 0
        self.num_queued_tokens = 0
        # The max_loras device slots (None: LoRA disabled); the policy may read them.
        self.loras = LoRASlots(config.max_loras) if config.max_loras else None
        if self.loras is not None:
            policy.attach_lora_slots(self.loras)
        self._on_schedule = policy.on_schedule if policy.wants_clock else None
        # None: speculation off (the hot paths test this one attribute).
        self.speculation = speculation if config.num_speculative_tokens else None
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.spec_num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens
        # The KV connector's scheduler side (None: no connector; the hot paths test this one
        # attribute). Requests waiting for a load hold blocks but no seat; a producer's finished
        # requests hold their blocks in ``sending`` until the consumer has read them.
        self.connector = kv_connector
        self.waiting_for_remote: dict[str, RemoteLoad] = {}
        # Waiting requests whose load finished: they hold its blocks until admitted, so a
        # request ahead of them that lacks blocks lets them go first (else neither moves).
        self._holding_loaded: set[str] = set()
        self.sending: dict[str, Request] = {}
        self._outgoing_params: dict[str, dict[str, Any]] = {}  # producer params, until output
        # Ids of requests in a batch still in the pipeline (the engine's batch queue under
        # pipeline parallelism, core.batch_queue): neither scheduled again nor preempted until
        # their batch returns. Empty otherwise (a step then tests it once, and each running
        # request one local against None).
        self.in_flight: set[str] = set()

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request. Raises ValueError for one that can never run."""
        cfg = self.config
        if request.request_id in self.requests or request.request_id in self.sending:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine.")
        if request.kv_transfer_params is not None:
            if self.connector is None:
                raise ValueError("kv_transfer_params needs an engine with a kv_transfer_config "
                                 "(--kv-transfer-config).")
            check_kv_transfer_params(request.kv_transfer_params)
        if request.num_prompt_tokens >= cfg.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"your request has {request.num_prompt_tokens} input tokens. Please reduce the "
                "length of the input messages.")
        # a sliding window bounds the blocks held at once to its own and one chunk's
        chunk = cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else cfg.max_model_len
        needed = self.kv.max_blocks_held(request.num_prompt_tokens + 1, chunk)
        if needed > self.kv.num_usable_blocks:
            raise ValueError(
                f"The prompt needs {needed} KV-cache blocks but the cache holds only "
                f"{cfg.num_gpu_blocks}; it could never be scheduled.")
        if request.lora is not None and self.loras is None:
            raise ValueError(f"the request uses LoRA adapter {request.lora!r} but LoRA is not "
                             "enabled (enable_lora / max_loras).")
        seats = request.sampling_params.n
        if seats > cfg.max_num_seqs:
            raise ValueError(f"n ({seats}) exceeds max_num_seqs ({cfg.max_num_seqs}).")
        self._multi_sample |= seats > 1
        room = cfg.max_model_len - request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        request.max_output_tokens = room if max_tokens is None else min(max_tokens, room)
        # The last token's KV is never written, so prompt + max_output - 1 tokens must fit.
        longest = self.kv.max_blocks_held(
            request.num_prompt_tokens + request.max_output_tokens - 1, chunk)
        if longest > self.kv.num_usable_blocks:
            raise ValueError(
                f"prompt + max_tokens need up to {longest} KV-cache blocks but the cache holds "
                f"only {cfg.num_gpu_blocks}; the request could never finish. Lower max_tokens.")
        self._check_admission(request)
        self.requests[request.request_id] = request
        self.policy.add(request)
        self.num_queued += 1
        self.num_queued_tokens += request.num_prompt_tokens
        if self.loras is not None:
            self.loras.add_waiting(request.lora)

    def free_seats(self) -> int:
        """Seats of the running batch (``max_num_seqs``) not taken: queued requests up to this
        many start at the next step instead of waiting."""
        return max(0, self.config.max_num_seqs - len(self.running))

    @property
    def is_plain_decoding(self) -> bool:
        """No n > 1 request seen and no policy watching the clock: a decode-only step changes
        nothing but tokens and blocks (``core.decode_run`` may then advance several at once)."""
        return not self._multi_sample and self._on_schedule is None and self.speculation is None \
            and self.connector is None

    def drop_finished_ids(self) -> None:
        """Forgets the ids finished since the last step, as a step whose output nobody reads
        would have handed them out (``core.decode_run``)."""
        self._finished_ids = []

    def finish_at_length(self, requests: list[Request], now: float) -> None:
        """Ends running requests that just sampled their last allowed token, as
        ``update_from_output`` does at the end of their step (a ``core.decode_run`` step)."""
        for request in requests:
            self._finish(request, _LENGTH_CAPPED, now)
        self.running = [r for r in self.running if r.status <= _LAST_UNFINISHED]

    def schedule_beside_run(self, decodes: SchedulerOutput, now: float) -> SchedulerOutput:
        """The step of a ``core.decode_run`` run that admits waiting requests beside its
        decodes (the run's closing step, ``DecodeRun.open_closing``): ``decodes`` holds the
        step's decode entries and their aggregates, their blocks already taken. The waiting
        requests are scheduled as ``schedule`` would after those decodes. Call only where
        ``admits_beside_runs``."""
        out = SchedulerOutput()
        out.finished_request_ids, self._finished_ids = self._finished_ids, out.finished_request_ids
        out.scheduled = list(decodes.scheduled)
        n = decodes.num_decode_seqs
        out.total_num_scheduled_tokens = out.num_decode_tokens = out.num_decode_seqs = n
        out.sum_context_tokens = decodes.sum_context_tokens
        out.sum_decode_context_tokens = decodes.sum_decode_context_tokens
        out.max_decode_context = decodes.max_decode_context
        self._schedule_waiting(out, self.config.max_num_batched_tokens - n, now)
        if out.preempted_request_ids or self.kv.block_ops is not None:
            raise RuntimeError("an admission beside a decode run preempted or queued copies")
        cfg = self.config
        if (out.total_num_scheduled_tokens > cfg.max_num_batched_tokens
                or len(self.running) > cfg.max_num_seqs
                or not 0 <= self.kv.pool.free_queue.num_free <= cfg.num_gpu_blocks):
            self._raise_broken_invariant(out)
        return out

    @property
    def admits_beside_runs(self) -> bool:
        """Whether an admission step changes nothing of the running decodes but blocks taken
        after theirs (``schedule_beside_run``): plain decoding, no LoRA, no queued copies, no
        prompts first, no swaps to bring back, and a policy that never preempts to admit."""
        cfg = self.config
        return (self.is_plain_decoding and self.loras is None and self.kv.block_ops is None
                and not cfg.prefill_first and cfg.preemption_mode == "recompute"
                and type(self.policy).should_preempt is SchedulingPolicy.should_preempt)

    def _check_admission(self, request: Request) -> None:
        """Raises EngineOverloaded when queueing ``request`` would pass a waiting bound. The
        request bound counts only the requests that will have to wait (those beyond the free
        seats), so a burst gets the same answer whether or not a step ran while it arrived."""
        cfg = self.config
        if cfg.max_waiting_requests is not None and \
                self.num_queued >= cfg.max_waiting_requests + self.free_seats():
            raise EngineOverloaded(
                f"the engine is overloaded: {self.num_queued} requests are queued for "
                f"{self.free_seats()} free seats (max_waiting_requests "
                f"{cfg.max_waiting_requests}); retry later.",
                "max_waiting_requests", ADMISSION_RETRY_AFTER_S)
        tokens = self.num_queued_tokens + request.num_prompt_tokens
        if cfg.max_waiting_tokens is not None and self.num_queued and \
                tokens > cfg.max_waiting_tokens:
            raise EngineOverloaded(
                f"the engine is overloaded: {self.num_queued_tokens} prompt tokens are waiting "
                f"(max_waiting_tokens {cfg.max_waiting_tokens}); retry later.",
                "max_waiting_tokens", ADMISSION_RETRY_AFTER_S)

    def abort_requests(self, request_ids: list[str], now: float) -> list[EngineCoreOutput]:
        """Ends requests wherever they are; unknown or finished ids are ignored. Call between
        steps (from the thread that runs them)."""
        return self.finish_requests(request_ids, now, RequestStatus.FINISHED_ABORTED)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's block-hash events since the last call (empty when the config's
        ``kv_events`` is off)."""
        events = self.kv.pool.events
        return [] if events is None else events.take()

    def has_unfinished_requests(self) -> bool:
        """True while requests run or wait, and while KV transfers are pending (loads or a
        producer's sends): the loop keeps stepping to poll its connector."""
        return bool(self.running) or len(self.policy) > 0 or bool(self.waiting_for_remote) \
            or bool(self.sending)

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.policy), self.kv.usage,
                              self.kv.prefix_queries, self.kv.prefix_hits, self.num_preemptions,
                              self.num_prompt_tokens, self.num_generation_tokens,
                              self.spec_num_drafts, self.spec_num_draft_tokens,
                              self.spec_num_accepted_tokens,
                              list(self.spec_num_accepted_tokens_per_pos),
                              self.num_prefill_tokens, *self._external_prefix_cache())

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: the queued prompts never admitted (whole: their cached
        part is found at admission) and what the running requests have left of theirs (read
        off the few that may have some left, not the whole batch; ``ReferenceScheduler`` sums
        the batch)."""
        left, done = 0, []
        for r in self._prefilling:
            if r.status == _RUNNING and r.num_computed_tokens < r.num_prompt_tokens:
                left += r.num_prompt_tokens - r.num_computed_tokens
            else:
                done.append(r)
        self._prefilling.difference_update(done)
        return self.num_queued_tokens + left

    def _external_prefix_cache(self) -> tuple[int, int]:
        """A connector's external prefix cache queries and hits (0, 0 for one that keeps none)."""
        stats = getattr(self.connector, "stats", None)
        if stats is None:
            return 0, 0
        return stats.external_prefix_cache_queries, stats.external_prefix_cache_hits

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()  # no keyword arguments: matching them costs more than the call
        # The ids finished so far leave with this step; ``out``'s fresh list collects the next.
        out.finished_request_ids, self._finished_ids = self._finished_ids, out.finished_request_ids
        cfg, kv = self.config, self.kv
        if self._on_schedule is not None:
            self._on_schedule(now)
        if cfg.prefill_first and len(self.policy):  # vLLM v0: prompts first, alone
            self._schedule_waiting(out, cfg.max_num_batched_tokens, now)
        if not out.scheduled:
            budget, preempted = self._schedule_running(out, cfg.max_num_batched_tokens, now)
            if not preempted and len(self.policy) and not cfg.prefill_first:
                self._schedule_waiting(out, budget, now)
        if self.loras is not None and self.loras.loads:
            out.lora_loads = self.loras.take_loads()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        if kv.block_ops is not None:
            ops = kv.take_block_ops()
            out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy = (
                ops.swap_out, ops.swap_in, ops.copy)
        # The step's invariants, tested inline (this runs every step); the error names the one.
        if (out.total_num_scheduled_tokens > cfg.max_num_batched_tokens
                or len(self.running) > cfg.max_num_seqs
                or not 0 <= kv.pool.free_queue.num_free <= cfg.num_gpu_blocks):
            self._raise_broken_invariant(out)
        return out

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        n = len(request.all_token_ids) - request.num_computed_tokens
        if n == 1:
            return 1
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        return min(n, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          now: float) -> tuple[int, bool]:
        running = self.running
        allocate = self.kv.allocate_slots
        # Without forks no partially filled block is shared, so a decode whose slot lies inside
        # its last block needs neither new blocks nor copy-on-write: skip allocate_slots (one that
        # starts a block gets it from ``append_slot``). With forks ``start % 1`` is 0 and every
        # decode takes the general path.
        forks = self._multi_sample
        spec = self.speculation
        # (under speculation every decode takes the general path: its drafts need slots)
        in_block = 1 if forks or spec is not None else self.kv.block_size
        scheduled = out.scheduled
        append = scheduled.append
        preempted = False
        num_others = decode_starts = 0  # decodes are counted once, after the loop
        max_start = -1
        table: BlockTable | None
        held = self.in_flight or None
        # Preemption only removes requests at or after the current one (and stops the loop when
        # it removes the current one), so iterating while it shrinks the list is safe.
        for request in running:
            if budget <= 0:
                break
            if held is not None and request.request_id in held:
                continue
            start = request.num_computed_tokens
            n = len(request.all_token_ids) - start
            if n == 1 and start % in_block:
                entry = request.decode_entry
                if entry is not None:  # the common case: a decode entry reused, counted inline
                    entry.start = start
                    append(entry)
                    budget -= 1
                    decode_starts += start
                    if start > max_start:
                        max_start = start
                    continue
                table = self.kv.tables[request.request_id]
            else:
                if n != 1:
                    n = self._num_new_tokens(request, budget)
                    table = allocate(request, n)
                elif spec is not None and start >= request.num_prompt_tokens:
                    n, lost = self._schedule_verification(request, start, budget, out, now)
                    preempted |= lost
                    if not n:  # the request itself was preempted
                        break
                    budget -= n
                    num_others += 1
                    continue
                elif forks:
                    table = allocate(request, 1)
                else:
                    table = self.kv.append_slot(request)
                if table is None:
                    table = self._preempt_until_allocated(request, n, out, now)
                    preempted = True
                    if table is None:
                        break
            budget -= n
            if n == 1 and start >= request.num_prompt_tokens:
                # One entry per running decode, updated in place from step to step rather than
                # rebuilt (the bulk of all entries); dropped when the block table goes away.
                entry = request.decode_entry
                if entry is None:
                    entry = request.decode_entry = ScheduledRequest(request, start, 1, table.ids,
                                                                    True, table.group_ids)
                else:  # a decode that needed a block (or a copy): same entry, same live table
                    entry.start = start
                    entry.block_ids = table.ids
                    entry.group_block_ids = table.group_ids
                append(entry)
                decode_starts += start
                if start > max_start:
                    max_start = start
            else:
                self._add_scheduled(out, request, n, table)
                num_others += 1
        num_decodes = len(scheduled) - num_others
        if num_decodes:  # the decode-only totals are still zero: no decode was counted yet
            decode_context = decode_starts + num_decodes  # each decode attends to start + 1
            out.total_num_scheduled_tokens += num_decodes
            out.num_decode_tokens += num_decodes
            out.num_decode_seqs += num_decodes
            out.sum_context_tokens += decode_context
            out.sum_decode_context_tokens += decode_context
            if max_start >= out.max_decode_context:
                out.max_decode_context = max_start + 1
        return budget, preempted

    def _preempt_until_allocated(self, request: Request, n: int, out: SchedulerOutput,
                                 now: float) -> BlockTable | None:
        """Preempts the policy's victims among the running requests from ``request`` on
        until ``request`` gets blocks for ``n`` tokens; None once ``request`` itself went."""
        running = self.running
        index = running.index(request)
        while True:
            victim = self.policy.select_victim(self._victims(running[index:]))
            self._preempt(victim, out, now)
            if victim is request:
                return None
            table = self.kv.allocate_slots(request, n)
            if table is not None:
                return table

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        cfg = self.config
        policy = self.policy
        loras = self.loras
        reserved = self._reserved_seats()
        # Requests passed over because their adapter would exceed max_loras, as vLLM skips them;
        # they go back in their places after the step (at most max_num_seqs are looked past).
        skipped: list[Request] = []
        try:
            while budget > 0:
                request = policy.peek()
                if request is None:
                    return
                lora = request.lora
                if lora is not None and loras is not None and not loras.can_acquire(lora):
                    if len(skipped) >= cfg.max_num_seqs or not loras.any_admissible():
                        return
                    skipped.append(policy.pop())
                    continue
                if self.connector is not None and not request.num_computed_tokens:
                    loading = self._start_remote_load(request)
                    if loading is None:  # no room for its blocks or its load: wait
                        if self._release_a_loaded(request):
                            continue
                        return
                    if loading:
                        continue
                seats = self._seats(request)
                has_seat = len(self.running) + reserved + seats <= cfg.max_num_seqs
                n = self._admit_blocks(request, budget) if has_seat else None
                if n is None and has_seat and self._holding_loaded and \
                        request.request_id not in self._holding_loaded and \
                        len(skipped) < cfg.max_num_seqs:  # loaded requests behind it go first
                    skipped.append(policy.pop())
                    continue
                if n is None:  # no seat or no blocks: the policy may evict someone it outranks
                    freed = self._preempt_for(request, out, now)
                    if freed is None:
                        if self._release_a_loaded(request):
                            continue
                        return
                    budget += freed
                    reserved = self._reserved_seats()
                    continue
                reserved += seats - 1
                policy.pop()
                self._admit(request, now)
                self._add_scheduled(out, request, n, self.kv.tables[request.request_id])
                budget -= n
        finally:
            for request in reversed(skipped):
                policy.unpop(request)

    def _release_a_loaded(self, request: Request) -> bool:
        """Where nothing running, loading or sending can free a block, the prompts loaded ahead
        of their admission (``_holding_loaded``) may hold every block while none of them gets
        the blocks for the rest of its prompt, and would wait for ever: the latest of them to
        arrive, ``request`` aside, gives its blocks back (its loaded blocks stay in the prefix
        cache until reused) and is looked up and loaded again at its turn. Whether one did."""
        holding = self._holding_loaded
        if self.running or self.waiting_for_remote or self.sending or not holding:
            return False
        for rid in reversed(self.requests):
            if rid in holding and rid != request.request_id:
                holding.discard(rid)
                holder = self.requests[rid]
                self.kv.free(holder)
                holder.num_computed_tokens = 0
                return True
        return False

    def _admit(self, request: Request, now: float) -> None:
        self._holding_loaded.discard(request.request_id)
        first_time = request.first_scheduled_time is None
        if first_time:
            request.first_scheduled_time = now
            self.num_queued -= 1
            self.num_queued_tokens -= request.num_prompt_tokens
        request.status = _RUNNING
        self.running.append(request)
        self.num_joined += 1
        self._prefilling.add(request)
        if self.loras is not None:
            self.loras.remove_waiting(request.lora)
            if request.lora is not None:
                self.loras.acquire(request.lora)
        self.policy.on_admit(request, now, first_time)

    def _admit_blocks(self, request: Request, budget: int) -> int | None:
        """Secures blocks for a waiting request's next chunk; returns its size or None."""
        kv = self.kv
        if request.swapped_out:
            n = self._num_new_tokens(request, budget)
            if not kv.can_swap_in(request, n):
                return None
            kv.swap_in(request)
            request.swapped_out = False
            kv.allocate_slots(request, n)  # cannot fail: can_swap_in counted these blocks
            return n
        if request.num_computed_tokens:  # its KV was loaded by a connector: it holds its blocks
            n = self._num_new_tokens(request, budget)
            return n if kv.allocate_slots(request, n) is not None else None
        hits, num_hit = self._prefix_hits(request)
        n = request.num_tokens - request.num_computed_tokens - num_hit
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        if n > budget:
            if not self.config.enable_chunked_prefill:
                return None
            n = budget
        if kv.allocate_slots(request, n, hits) is None:
            return None
        kv.record_prefix_lookup(request.num_tokens, num_hit)
        request.num_computed_tokens += num_hit
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit
        return n

    def _prefix_hits(self, request: Request) -> tuple[list[Any], int]:
        hits, num_hit = self.kv.get_computed_blocks(request)
        if num_hit and request.sampling_params.skip_reading_prefix_cache:
            return [], 0  # prompt_logprobs: every prompt position needs its logits
        return hits, num_hit

    def _seats(self, request: Request) -> int:
        """Running slots a request needs: an unforked n > 1 request reserves one per sample."""
        if request.parent_id is None and request.num_output_tokens == 0:
            return request.sampling_params.n
        return 1

    def _reserved_seats(self) -> int:
        """Seats held for the future children of running, not yet forked n > 1 requests."""
        if not self._multi_sample:
            return 0
        return sum(self._seats(r) - 1 for r in self.running)

    def _preempt_for(self, request: Request, out: SchedulerOutput, now: float) -> int | None:
        """Lets the policy evict a running request that ``request`` outranks. Returns the
        tokens given back to the step's budget, or None when nobody is evicted."""
        candidates = self._victims(self.running)
        if not candidates:
            return None
        victim = self.policy.select_victim(candidates)
        if not self.policy.should_preempt(request, victim):
            return None
        freed = self._unschedule(victim, out)
        self._preempt(victim, out, now)
        return freed

    def _victims(self, requests: list[Request]) -> list[Request]:
        """Who may be preempted: not a request in flight (its batch still computes it)."""
        held = self.in_flight
        return [r for r in requests if r.request_id not in held] if held else requests

    def _unschedule(self, victim: Request, out: SchedulerOutput) -> int:
        for k, sr in enumerate(out.scheduled):
            if sr.request is victim:
                del out.scheduled[k]
                self._count(out, sr, -1)
                return sr.num_new_tokens
        return 0

    def _preempt(self, victim: Request, out: SchedulerOutput, now: float) -> None:
        self.running.remove(victim)
        if victim.lora is not None and self.loras is not None:
            self.loras.release(victim.lora)
        victim.decode_entry = None
        victim.spec_token_ids = ()
        self.kv.register_own(victim)  # it may look its blocks up again
        swapped = self.config.preemption_mode == "swap" and self.kv.swap_out(victim)
        if not swapped:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
        victim.swapped_out = swapped
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.requeue(victim)
        if self.loras is not None:
            self.loras.add_waiting(victim.lora)
        out.preempted_request_ids.append(victim.request_id)

    def _add_scheduled(self, out: SchedulerOutput, request: Request, n: int,
                       table: BlockTable) -> None:
        start = request.num_computed_tokens
        sr = ScheduledRequest(request, start, n, table.ids, start + n == len(request.all_token_ids),
                              table.group_ids)
        out.scheduled.append(sr)
        self._count(out, sr, 1)
        if sr.sample and self.speculation is not None:  # drafts right after the prompt
            sr.num_draft_next = self._num_draft_next(request, 1, out)

    @staticmethod
    def _count(out: SchedulerOutput, sr: ScheduledRequest, sign: int) -> None:
        n, start = sr.num_new_tokens, sr.start
        out.total_num_scheduled_tokens += sign * n
        num_spec = len(sr.spec_token_ids)
        if num_spec or (n == 1 and start >= sr.request.num_prompt_tokens):
            # a decode of n = 1 + num_spec tokens: its i-th token attends to start + i
            context = n * start + n * (n + 1) // 2
            out.sum_context_tokens += sign * context
            out.sum_decode_context_tokens += sign * context
            out.num_decode_tokens += sign * n
            out.num_decode_seqs += sign
            out.num_spec_tokens += sign * num_spec
            if sign > 0:  # after an unschedule the maximum is an upper bound
                out.max_decode_context = max(out.max_decode_context, start + n)
        else:
            out.sum_context_tokens += sign * (n * start + n * (n + 1) // 2)
            if start:
                out.num_prefix_chunks += sign
                out.sum_prefix_context_tokens += sign * start
            out.sum_prefill_attention_area += sign * n * (start + n)
            out.num_prefill_tokens += sign * n
            out.num_prefill_seqs += sign

    def _raise_broken_invariant(self, out: SchedulerOutput) -> None:
        cfg = self.config
        if out.total_num_scheduled_tokens > cfg.max_num_batched_tokens:
            raise RuntimeError("scheduler exceeded max_num_batched_tokens")
        if len(self.running) > cfg.max_num_seqs:
            raise RuntimeError("scheduler exceeded max_num_seqs")
        raise RuntimeError("free block count out of range")

    # ---- after the step ------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput,
                           now: float) -> list[EngineCoreOutput]:
        """Applies a step's results. Returns one output per request that got tokens (only the
        finished ones when the scheduler was built with ``stream_outputs=False``)."""
        outputs: list[EngineCoreOutput] = []
        kv = self.kv
        cache_every = self._cache_every
        get_tokens = result.sampled_token_ids.get
        logprobs = result.logprobs
        extras = result.prompt_logprobs or result.pooled  # prompt logprobs, pooled states
        stream = self.stream_outputs
        no_forks = not self._multi_sample
        on_tokens = self._on_tokens
        spec = self.speculation
        scheduled = out.scheduled
        # Entries without a token appended inline (the rest got exactly one: counted at the end).
        num_others = 0
        any_finished = False
        for sr in scheduled:
            request = sr.request
            if request.status > _LAST_UNFINISHED:  # aborted while the step ran
                num_others += 1
                continue
            if spec is not None and sr.sample and (sr.spec_token_ids or sr.num_draft_next):
                num_others += 1
                spec_output = self._apply_speculative(sr, result, now)
                if request.status > _LAST_UNFINISHED:
                    any_finished = True
                if spec_output is not None:
                    outputs.append(spec_output)
                continue
            start = sr.start
            n = sr.num_new_tokens
            num_computed = request.num_computed_tokens = start + n
            if start < request.num_prompt_tokens:
                self.num_prompt_tokens += min(n, request.num_prompt_tokens - start)
            if num_computed % cache_every < n:
                kv.cache_full_blocks(request)  # a block boundary was crossed
            if not sr.sample:
                num_others += 1
                continue
            tokens: Any = get_tokens(request.request_id)  # None when the backend lost one
            try:  # unpacking tests for exactly one token at the cost of one instruction
                (token,) = tokens
                inline = no_forks and token not in request.stop_ids
            except (TypeError, ValueError):  # no token list, or several tokens
                if not tokens:
                    raise RuntimeError(
                        f"backend returned no token for {request.request_id!r}") from None
                inline = False
            if inline:
                # The common case inline: one token, no stop token, nothing to fork.
                output = request.output_token_ids
                output.append(token)
                request.all_token_ids.append(token)
                request.token_times.append(now)
                if request.first_token_time is None:
                    request.first_token_time = now
                if on_tokens is not None:
                    on_tokens(request, 1)
                if len(output) < request.max_output_tokens:
                    if not stream:
                        continue
                    status = None
                else:
                    status = _LENGTH_CAPPED
            else:
                num_others += 1
                tokens, status = self._append_tokens(request, tokens, now)
            if status is not None:
                self._finish(request, status, now)
                any_finished = True
            elif not stream:
                continue
            outputs.append(EngineCoreOutput(
                request.request_id, tokens, status is not None,
                None if status is None else request.finish_reason, request.stop_reason,
                request.num_cached_tokens or 0,
                logprobs.get(request.request_id) if logprobs else None))
            if extras:
                attach_prompt_results(outputs[-1], result)
        self.num_generation_tokens += len(scheduled) - num_others
        if any_finished:
            self.running = [r for r in self.running if r.status <= _LAST_UNFINISHED]
        if self.connector is not None:
            self._connector_step(outputs, result, now)
        return outputs

    def _append_tokens(self, request: Request, tokens: list[int],
                       now: float) -> tuple[list[int], RequestStatus | None]:
        """Appends sampled tokens up to the first stop; returns those kept and the stop."""
        status = None
        for k, token in enumerate(tokens):
            request.append_output_token(token, now)
            status = self._check_stop(request, token)
            if status is not None:
                tokens = tokens[:k + 1]
                break
        self.num_generation_tokens += len(tokens)
        if self.policy.accounts_tokens:
            self.policy.on_output_tokens(request, len(tokens))
        if self._multi_sample and request.parent_id is None and request.sampling_params.n > 1 \
                and len(request.output_token_ids) == len(tokens):
            self._fork_children(request, now)
        return tokens, status

    @staticmethod
    def _check_stop(request: Request, token: int) -> RequestStatus | None:
        """EOS (unless ignore_eos) and stop token ids once min_tokens are out, then the length
        cap (max_tokens or max_model_len), as in vLLM."""
        num_out = len(request.output_token_ids)
        if token in request.stop_ids and num_out >= request.sampling_params.min_tokens:
            if token != request.eos_token_id or request.sampling_params.ignore_eos:
                request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if num_out >= request.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _fork_children(self, parent: Request, now: float) -> None:
        """n > 1: the other samples share the parent's prompt KV; each recomputes the last prompt
        token (copy-on-write of the shared last block) to sample its own first token."""
        for index in range(1, parent.sampling_params.n):
            child = Request(child_request_id(parent.request_id, index), parent.prompt_token_ids,
                            parent.sampling_params, parent.arrival_time, parent.eos_token_id,
                            parent.priority, parent.tenant, parent.lora, dict(parent.hints),
                            parent_id=parent.request_id, index=index)
            child.status = RequestStatus.RUNNING
            child.first_scheduled_time = now
            child.num_cached_tokens = parent.num_cached_tokens
            child.max_output_tokens = parent.max_output_tokens
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_prompt_tokens - 1
            self.requests[child.request_id] = child
            self.running.append(child)
            self.num_joined += 1
            self._prefilling.add(child)
            if child.lora is not None and self.loras is not None:
                self.loras.acquire(child.lora)  # resident and pinned by the parent: no load

    def finish_requests(self, request_ids: list[str], now: float,
                        status: RequestStatus = RequestStatus.FINISHED_STOPPED,
                        ) -> list[EngineCoreOutput]:
        """Ends requests the front-end decided are done (a stop string was detokenized, the
        client went away). Unknown or already finished ids are ignored."""
        outs = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            was_running = request.status == RequestStatus.RUNNING
            loading = self.waiting_for_remote.pop(rid, None) is not None
            if was_running:
                self.running.remove(request)
            elif loading:  # its load is abandoned; _finish frees its blocks
                self.connector.request_aborted(rid)  # type: ignore[union-attr]
            self._finish(request, status, now)
            if not was_running:
                if not loading:
                    self.policy.remove(request)
                if self.loras is not None:
                    self.loras.remove_waiting(request.lora)
                if request.first_scheduled_time is None:
                    self.num_queued -= 1
                    self.num_queued_tokens -= request.num_prompt_tokens
            outs.append(EngineCoreOutput(rid, [], True, request.finish_reason,
                                         num_cached_tokens=request.num_cached_tokens or 0,
                                         kv_transfer_params=self._outgoing_params.pop(rid, None)))
        return outs

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        self._holding_loaded.discard(request.request_id)
        if request.lora is not None and self.loras is not None and request.status == _RUNNING:
            self.loras.release(request.lora)
        request.status = status
        request.finish_time = now
        if self.connector is None or not self._delay_free(request):
            self.kv.free(request)
        request.decode_entry = None
        request.spec_token_ids = ()
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        self.policy.on_finish(request)

def make_request(request_id: str, prompt_token_ids: list[int], arrival_time: float = 0.0,
                 sampling_params: SamplingParams | None = None, **kwargs) -> Request:
    """Shorthand for tests and scripts."""
    return Request(request_id, list(prompt_token_ids), sampling_params or SamplingParams(),
                   arrival_time, **kwargs)
