"""``ReferenceScheduler``: the shared scheduler without its fast paths, the plain version the
fast one is tested against (``tests/core/test_scheduler_reference.py``)."""

from __future__ import annotations

from twinserve.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, attach_prompt_results
from twinserve.core.scheduler import Scheduler


class ReferenceScheduler(Scheduler):
    """The scheduler without its fast paths: every running request through ``allocate_slots``
    and ``_add_scheduled``, every sampled token through ``_append_tokens``. Same decisions, same
    outputs, written plainly; ``tests/core/test_scheduler_reference.py`` runs both side by side on
    random workloads and compares them step by step. Not for serving (it is slower)."""

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_queued_tokens + sum(
            r.num_prompt_tokens - r.num_computed_tokens for r in self.running
            if r.num_computed_tokens < r.num_prompt_tokens)

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          now: float) -> tuple[int, bool]:
        preempted = False
        for request in self.running:  # preemption removes only requests at or after this one
            if budget <= 0:
                break
            n = self._num_new_tokens(request, budget)
            table = self.kv.allocate_slots(request, n)
            if table is None:
                table = self._preempt_until_allocated(request, n, out, now)
                preempted = True
                if table is None:
                    break
            budget -= n
            self._add_scheduled(out, request, n, table)
        return budget, preempted

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput,
                           now: float) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        block_size, caching = self.config.block_size, self.config.enable_prefix_caching
        any_finished = False
        for sr in out.scheduled:
            request = sr.request
            if request.is_finished:  # aborted while the step ran
                continue
            start, n = sr.start, sr.num_new_tokens
            request.num_computed_tokens = start + n
            if start < request.num_prompt_tokens:
                self.num_prompt_tokens += min(n, request.num_prompt_tokens - start)
            if caching and (start + n) // block_size > start // block_size:
                self.kv.cache_full_blocks(request)
            if not sr.sample:
                continue
            tokens = result.sampled_token_ids.get(request.request_id)
            if not tokens:
                raise RuntimeError(f"backend returned no token for {request.request_id!r}")
            tokens, status = self._append_tokens(request, list(tokens), now)
            if status is not None:
                self._finish(request, status, now)
                any_finished = True
            elif not self.stream_outputs:
                continue
            outputs.append(EngineCoreOutput(
                request.request_id, tokens, status is not None,
                None if status is None else request.finish_reason, request.stop_reason,
                request.num_cached_tokens or 0,
                result.logprobs.get(request.request_id) if result.logprobs else None))
            attach_prompt_results(outputs[-1], result)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs
