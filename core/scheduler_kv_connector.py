"""The KV connector's hooks in the shared scheduler (``core.kv_connector``, vLLM's shape).

A waiting request whose prompt can be loaded from outside takes its blocks and waits in
``waiting_for_remote`` (no seat, no step) until the worker side reports the load; a producer's
finished request keeps its blocks in ``sending`` until its reader is done.

``KVConnectorSteps`` is a part of ``core.scheduler.Scheduler`` kept in its own file: its methods
read and write the scheduler's state, declared below for the type checker only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twinserve.core.kv_connector import KVConnectorOutput, KVConnectorScheduler
from twinserve.core.outputs import EngineCoreOutput, ModelRunnerOutput
from twinserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from twinserve.core.config import SchedulerConfig
    from twinserve.core.kv_cache_manager import KVCacheManager
    from twinserve.core.lora import LoRASlots
    from twinserve.core.policy import SchedulingPolicy


@dataclass(slots=True)
class RemoteLoad:
    """A request in ``WAITING_FOR_REMOTE_KVS``: its prompt is computed up to ``num_tokens`` once
    its connector reports the load finished."""

    request: Request
    num_tokens: int




class KVConnectorSteps:
    """The scheduler's KV connector steps (mixed into ``Scheduler``)."""

    if TYPE_CHECKING:
        config: SchedulerConfig
        kv: KVCacheManager
        policy: SchedulingPolicy
        loras: LoRASlots | None
        connector: KVConnectorScheduler | None
        waiting_for_remote: dict[str, RemoteLoad]
        sending: dict[str, Request]
        num_queued: int
        num_queued_tokens: int
        _holding_loaded: set[str]
        _outgoing_params: dict[str, dict[str, Any]]

        def _prefix_hits(self, request: Request) -> tuple[list[Any], int]: ...

        def _finish(self, request: Request, status: RequestStatus, now: float) -> None: ...

    def _start_remote_load(self, request: Request) -> bool | None:
        """Asks the connector for the waiting request's prompt past its prefix-cache hits. An
        asynchronous load takes blocks for hits and loaded tokens and parks the request in
        ``waiting_for_remote`` (True); nothing to load: False; no room: None. Loads in flight
        are bounded by ``max_num_seqs`` (vLLM bounds them only by blocks); they take no seat."""
        connector = self.connector
        assert connector is not None
        if len(self.waiting_for_remote) >= self.config.max_num_seqs:
            return None
        hits, num_hit = self._prefix_hits(request)
        num_external, is_async = connector.get_num_new_matched_tokens(request, num_hit)
        if num_external <= 0:
            return False
        if not is_async:
            raise RuntimeError("synchronous KV loads are not implemented: the connector must "
                               "load asynchronously.")
        table = self.kv.allocate_slots(request, num_external, hits)
        if table is None:
            return None
        self.kv.record_prefix_lookup(request.num_tokens, num_hit)
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit
        connector.update_state_after_alloc(request, table.ids, num_external)
        self.policy.pop()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[request.request_id] = RemoteLoad(request, num_hit + num_external)
        return True

    def _update_connector(self, report: KVConnectorOutput, now: float) -> list[EngineCoreOutput]:
        """Applies the worker side's report: loaded requests rejoin the queue first in line,
        failed loads follow ``kv_load_failure_policy``, read sends free their blocks."""
        connector = self.connector
        assert connector is not None
        outputs = []
        ended = report.finished_recving | report.failed_recving
        # in load order, put back first in line latest first: the earliest ends up in front
        for rid in reversed([rid for rid in self.waiting_for_remote if rid in ended]):
            load = self.waiting_for_remote.pop(rid)
            if rid not in report.failed_recving:
                self._finish_load(load)
            else:
                failed = self._fail_load(load, now)
                if failed is not None:
                    outputs.append(failed)
        if report.finished_sending:  # in finishing order: a set's order varies between runs
            for rid in [rid for rid in self.sending if rid in report.finished_sending]:
                self.kv.free(self.sending.pop(rid))
        connector.update_connector_output(report)
        return outputs

    def _finish_load(self, load: RemoteLoad) -> None:
        """The loaded tokens count as computed, except the prompt's last (recomputed for its
        logits, as vLLM does); the loaded full blocks enter the prefix cache."""
        request = load.request
        request.num_computed_tokens = min(load.num_tokens, request.num_tokens - 1)
        if request.num_computed_tokens >= self.kv.block_size:
            self.kv.cache_full_blocks(request)
        request.status = RequestStatus.WAITING
        self.policy.unpop(request)
        self._holding_loaded.add(request.request_id)

    def _fail_load(self, load: RemoteLoad, now: float) -> EngineCoreOutput | None:
        """``recompute``: the request frees its blocks and computes its prompt here; ``fail``:
        it ends with finish_reason "error"."""
        request = load.request
        assert self.connector is not None
        self.kv.free(request)
        request.num_computed_tokens = 0
        if self.connector.config.kv_load_failure_policy == "recompute":
            request.status = RequestStatus.WAITING
            self.policy.unpop(request)
            return None
        self._finish(request, RequestStatus.FINISHED_ERROR, now)
        if request.first_scheduled_time is None:
            self.num_queued -= 1
            self.num_queued_tokens -= request.num_prompt_tokens
        if self.loras is not None:
            self.loras.remove_waiting(request.lora)
        remote = (request.kv_transfer_params or {}).get("remote_engine_id")
        return EngineCoreOutput(request.request_id, [], True, request.finish_reason,
                                error=f"loading the prompt's KV cache from engine {remote!r} "
                                      "failed or timed out (kv_load_failure_policy 'fail').")

    def _connector_step(self, outputs: list[EngineCoreOutput], result: ModelRunnerOutput,
                        now: float) -> None:
        """The connector's part of ``update_from_output``: a producer's params onto its
        finishing outputs, then the worker side's report."""
        if self._outgoing_params:
            for output in outputs:
                if output.finished:
                    output.kv_transfer_params = self._outgoing_params.pop(output.request_id, None)
        if result.kv_connector_output is not None:
            outputs += self._update_connector(result.kv_connector_output, now)

    def _delay_free(self, request: Request) -> bool:
        """A producer's finished request keeps its blocks in ``sending`` until the consumer has
        read them (the connector decides); its params for the consumer go with its output."""
        table = self.kv.tables.get(request.request_id)
        delay, params = self.connector.request_finished(  # type: ignore[union-attr]
            request, [] if table is None else list(table.ids))
        if params is not None:
            self._outgoing_params[request.request_id] = params
        if delay:
            self.sending[request.request_id] = request
        return delay


