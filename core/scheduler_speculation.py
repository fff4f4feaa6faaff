"""Speculative decoding in the shared scheduler: the verification entry of a running decode, the
rollback of its rejected drafts and the next step's draft count (a ``SpeculationPolicy``).

A running decode with drafts verifies them in the same entry (1 + k tokens, k clipped to the
step's budget and to the request's remaining output); ``update_from_output`` rolls
``num_computed_tokens`` back by the rejected drafts, caches only verified blocks and releases the
lookahead blocks past them::

    before   | computed ... start | t d1 d2 d3 |        1 + k = 4 tokens, slots allocated
    verified | computed ... start | t d1 |             d1 accepted, d2 rejected: 2 tokens back
    after    num_computed = start + 2, blocks kept for start + 2 + 1 tokens, the rest freed

``SpeculationSteps`` is a part of ``core.scheduler.Scheduler`` kept in its own file: its methods
read and write the scheduler's state, declared below for the type checker only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinserve.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    attach_prompt_results,
)
from twinserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from twinserve.core.config import SchedulerConfig
    from twinserve.core.kv_cache_manager import BlockTable, KVCacheManager
    from twinserve.core.speculation import SpeculationPolicy


class SpeculationSteps:
    """The scheduler's speculative-decoding steps (mixed into ``Scheduler``)."""

    if TYPE_CHECKING:
        config: SchedulerConfig
        kv: KVCacheManager
        running: list[Request]
        speculation: SpeculationPolicy | None
        stream_outputs: bool
        num_prompt_tokens: int
        spec_num_drafts: int
        spec_num_draft_tokens: int
        spec_num_accepted_tokens: int
        spec_num_accepted_tokens_per_pos: list[int]

        def _preempt_until_allocated(self, request: Request, n: int, out: SchedulerOutput,
                                     now: float) -> BlockTable | None: ...

        @staticmethod
        def _count(out: SchedulerOutput, sr: ScheduledRequest, sign: int) -> None: ...

        def _append_tokens(self, request: Request, tokens: list[int],
                           now: float) -> tuple[list[int], RequestStatus | None]: ...

        def _finish(self, request: Request, status: RequestStatus, now: float) -> None: ...

    def _schedule_verification(self, request: Request, start: int, budget: int,
                               out: SchedulerOutput, now: float) -> tuple[int, bool]:
        """A running decode's entry under speculation: its token and up to k of its drafts,
        k clipped so that the step stays within ``budget`` and the request's output cannot pass
        ``max_output_tokens``; the drafts are dropped (never the token) when blocks lack. Returns
        the tokens scheduled (0: the request itself was preempted) and whether anyone was."""
        drafts = request.spec_token_ids
        k = min(len(drafts), budget - 1,
                request.max_output_tokens - len(request.output_token_ids) - 1)
        table = self.kv.allocate_slots(request, 1 + k) if k > 0 else None
        if table is None:
            k = 0
            table = self.kv.allocate_slots(request, 1)
        preempted = table is None
        if table is None:
            table = self._preempt_until_allocated(request, 1, out, now)
            if table is None:
                return 0, True
        entry = request.decode_entry
        if entry is None:
            entry = request.decode_entry = ScheduledRequest(request, start, 1 + k, table.ids, True,
                                                            table.group_ids)
        else:
            entry.start, entry.num_new_tokens = start, 1 + k
            entry.block_ids, entry.group_block_ids = table.ids, table.group_ids
        entry.spec_token_ids = list(drafts[:k]) if k > 0 else ()
        out.scheduled.append(entry)
        self._count(out, entry, 1)
        entry.num_draft_next = self._num_draft_next(request, 1 + k, out)
        return 1 + k, preempted

    def _num_draft_next(self, request: Request, num_new: int, out: SchedulerOutput) -> int:
        """The speculation policy's drafts for ``request`` after this step, clipped to what its
        next step could verify (``num_new`` tokens of this step may all become output). A request
        under a grammar gets none: its drafts are not constrained by it (docs)."""
        spec = self.speculation
        if spec is None or request.sampling_params.structured_outputs is not None \
                or request.pooling_params is not None:
            return 0
        room = request.max_output_tokens - len(request.output_token_ids) - num_new - 1
        if room <= 0:
            return 0
        budget = self.config.max_num_batched_tokens - out.total_num_scheduled_tokens
        wanted = spec.num_drafts(request, len(self.running), budget)
        return max(0, min(wanted, spec.k_max, self.config.num_speculative_tokens, room))

    def _apply_speculative(self, sr: ScheduledRequest, result: ModelRunnerOutput,
                           now: float) -> EngineCoreOutput | None:
        """``update_from_output`` for an entry that verified drafts or asked for some: the
        rollback of the rejected drafts, caching of the verified blocks only, release of the
        lookahead blocks past them, then the tokens and the next drafts."""
        request, kv = sr.request, self.kv
        rid = request.request_id
        tokens = result.sampled_token_ids.get(rid)
        k = len(sr.spec_token_ids)
        if not tokens or len(tokens) > k + 1:
            raise RuntimeError(f"backend returned {len(tokens or ())} tokens for {rid!r}, which "
                               f"verified {k} drafts (expected 1 to {k + 1}).")
        start, n = sr.start, sr.num_new_tokens
        if start < request.num_prompt_tokens:
            self.num_prompt_tokens += min(n, request.num_prompt_tokens - start)
        num_computed = request.num_computed_tokens = start + n - (k + 1 - len(tokens))
        if k:
            self._record_verification(request, k, len(tokens) - 1)
        kv.free_tail(request, num_computed + 1)
        if not k:  # as without drafts: cached before the token (and an n > 1 fork)
            kv.cache_full_blocks(request)
        proposals = result.spec_token_ids.get(rid)
        tokens, status = self._append_tokens(request, list(tokens), now)
        if status is not None:
            self._finish(request, status, now)
            proposals = None
        elif k:  # the accepted drafts are the request's tokens now: their full blocks are cached
            kv.cache_full_blocks(request)
        if proposals:
            request.spec_token_ids = list(proposals[:sr.num_draft_next])
        else:
            request.spec_token_ids = ()
        if status is None and not self.stream_outputs:
            return None
        logprobs = result.logprobs
        output = EngineCoreOutput(rid, tokens, status is not None,
                                  None if status is None else request.finish_reason,
                                  request.stop_reason, request.num_cached_tokens or 0,
                                  logprobs.get(rid) if logprobs else None)
        if result.prompt_logprobs or result.pooled:
            attach_prompt_results(output, result)
        return output

    def _record_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        request.spec_num_drafts += 1
        request.spec_num_draft_tokens += num_drafts
        request.spec_num_accepted_tokens += num_accepted
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        per_pos = self.spec_num_accepted_tokens_per_pos
        for pos in range(num_accepted):
            per_pos[pos] += 1
        if self.speculation is not None:
            self.speculation.on_verified(request, num_drafts, num_accepted)

