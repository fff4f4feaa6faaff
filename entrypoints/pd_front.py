"""The disaggregated prefill/decode front: X prefill and Y decode engine processes behind one
router (``routers/disaggregated.py``, the object the twin's P/D fleet routes through).

A request goes to a prefill instance as a one-token request marked ``do_remote_decode``; its
finishing output's ``kv_transfer_params`` then go, with the original request, to a decode
instance, which loads the prompt's KV through the Peer connector and decodes. The prefill
instance's token is discarded (vLLM's proxy does the same). Everything else is the
data-parallel front's: processes, pinning to cores, per-instance health and metrics (instances
``0..X-1`` are the prefill pool, ``X..X+Y-1`` the decode pool), deaths, shutdown.

For measurement (``twinserve validate --prefill-instances``), ``record_instances=True`` keeps
each finished request's ``RequestRecord`` per instance, its times moved onto ``time.monotonic()``
(the instance reports the monotonic time its clock counts from when it is ready): a prefill
instance's record and a decode instance's of one request, on the front's clock.

Faults: a decode instance that dies ends its requests with ``ReplicaDied``; the producer frees
the blocks it was serving when the reader's connection closes (or at its transfer timeout). A
prefill instance that dies mid-transfer fails the load: the decode instance applies
``kv_load_failure_policy`` (``recompute``: it computes the prompt itself).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.core.errors import EngineOverloaded
from twinserve.core.kv_transfer_config import KVTransferConfig
from twinserve.core.metrics import RequestRecord, StepRecord
from twinserve.core.pool_args import check_pool_args, pool_engine_args
from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import ADMISSION_RETRY_AFTER_S, SchedulerStats
from twinserve.core.step_sample import StepSample
from twinserve.entrypoints.dp_front import MAX_PENDING_RECORDS, DataParallelFront, Sink
from twinserve.gpu.engine.dp_client import ReplicaEvent
from twinserve.gpu.engine.engine_process import Refusal
from twinserve.routers import NoHealthyReplica, make_router
from twinserve.routers.disaggregated import (
    DisaggregatedRouter,
    prefill_kv_transfer_params,
    prefill_sampling_params,
)


@dataclass(slots=True, frozen=True)
class PDDeployment:
    """``prefill_instances`` X and ``decode_instances`` Y (vLLM's xPyD), and each pool's
    engine-argument overrides (``core/pool_args.py``)."""

    prefill_instances: int
    decode_instances: int
    prefill_args: dict[str, Any] = field(default_factory=dict)
    decode_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("prefill_instances", "decode_instances"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {n!r}.")
        for name in ("prefill_args", "decode_args"):
            object.__setattr__(self, name, check_pool_args(getattr(self, name), name))

    @classmethod
    def of(cls, prefill_instances: int | None, decode_instances: int | None,
           prefill_args: Any = None, decode_args: Any = None) -> PDDeployment | None:
        """None when neither count is given; both or neither; pool arguments only with them."""
        if prefill_instances is None and decode_instances is None:
            for name, value in (("prefill_args", prefill_args), ("decode_args", decode_args)):
                if value is not None:
                    raise ValueError(f"{name} is set but the deployment is not disaggregated "
                                     "(set prefill_instances and decode_instances).")
            return None
        if prefill_instances is None or decode_instances is None:
            raise ValueError("prefill_instances and decode_instances go together: give both.")
        return cls(prefill_instances, decode_instances, prefill_args or {}, decode_args or {})

    @property
    def size(self) -> int:
        return self.prefill_instances + self.decode_instances


def instance_args(args: EngineArgs, pd: PDDeployment) -> list[EngineArgs]:
    """Each instance's arguments: ``args`` with its pool's overrides, its role, engine id and
    side-channel port (``kv_port`` + its index). ``args.kv_transfer_config`` (if any) gives the
    rest: the port base, the failure policy and the transfer timeout."""
    if args.data_parallel_size > 1:
        raise ValueError("data_parallel_size with prefill_instances and decode_instances: the "
                         "pools are the replicas; give one or the other.")
    base = args.kv_transfer_config or KVTransferConfig()
    if base.kv_connector != "PeerConnector":
        raise ValueError(f"kv_transfer_config.kv_connector {base.kv_connector!r}: prefill and "
                         "decode instances need the PeerConnector.")
    if base.kv_port + pd.size - 1 > 65535:
        raise ValueError(f"kv_transfer_config.kv_port {base.kv_port}: the {pd.size} instances "
                         "use kv_port .. kv_port + instances - 1, past 65535.")
    pools = {True: pool_engine_args(args, pd.prefill_args, "prefill_args"),
             False: pool_engine_args(args, pd.decode_args, "decode_args")}
    out = []
    for i in range(pd.size):
        prefill = i < pd.prefill_instances
        name = f"prefill-{i}" if prefill else f"decode-{i - pd.prefill_instances}"
        config = dataclasses.replace(base, kv_role="kv_producer" if prefill else "kv_consumer",
                                     engine_id=name, kv_port=base.kv_port + i)
        out.append(pools[prefill].replace(kv_transfer_config=config))
    return out


@dataclass(slots=True, frozen=True)
class InstanceRecord:
    """A finished request's record on instance ``instance`` (``0..X-1`` prefill, then decode),
    its times on ``time.monotonic()``."""

    instance: int
    record: RequestRecord


def on_monotonic(record: RequestRecord, origin: float) -> RequestRecord:
    """``record`` with its times (seconds from an engine's start) moved by ``origin``, the
    ``time.monotonic()`` at that start."""
    return dataclasses.replace(
        record, arrival_time=record.arrival_time + origin,
        first_scheduled_time=record.first_scheduled_time + origin,
        first_token_time=record.first_token_time + origin,
        finish_time=record.finish_time + origin)


class DisaggregatedFront(DataParallelFront):
    """The data-parallel front over X + Y instances, routing each request through a prefill
    instance then a decode instance. ``record_instances``: keep each instance's records
    (``take_instance_records``; the newest MAX_PENDING_RECORDS) and steps (``take_steps``)."""

    def __init__(self, args: EngineArgs, pd: PDDeployment, usage_context: str, on_cuda: bool,
                 tokenize: Callable[[str], list[int]] | None = None,
                 router: DisaggregatedRouter | None = None, record_instances: bool = False) -> None:
        replicas = instance_args(args, pd)
        self.pd = pd
        # each instance's clock origin (time.monotonic()) and resolved configuration, as it
        # reported them when ready (set before the base's reader starts)
        self.origins: list[float] = [math.nan] * pd.size
        self.instance_configs: list[dict[str, Any]] = [{} for _ in range(pd.size)]
        self._instance_records: deque[InstanceRecord] | None = (
            deque(maxlen=MAX_PENDING_RECORDS) if record_instances else None)
        self.pd_router = router if router is not None else DisaggregatedRouter.of(
            pd.prefill_instances, pd.decode_instances, args.block_size)
        # requests between their prefill's submission and their decode's: an abort in that
        # window (the prefill finished, the decode not yet sent) must stop the hand-off
        self._prefilling: dict[str, _PrefillSink] = {}
        # (the base's own router is never asked: submit routes through pd_router)
        super().__init__(args.replace(data_parallel_size=pd.size), usage_context, on_cuda,
                         tokenize, make_router("round-robin", args.block_size), replicas,
                         record_steps=record_instances)

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               kwargs: dict[str, Any], sink: Sink) -> int:
        """Routes the request to a prefill instance; its sink gets ``None`` once accepted there,
        then the decode instance's outputs (or the exception that ended it)."""
        if kwargs.get("kv_transfer_params") is not None:
            raise ValueError("kv_transfer_params: the prefill/decode front sets them itself.")
        if params.n > 1:
            raise ValueError("n > 1 with prefill and decode instances is not implemented.")
        tokens = prompt if isinstance(prompt, list) else (
            self._tokenize(prompt) if self._tokenize is not None else [])
        routed = Request(request_id, list(tokens) or [0], params, 0.0)
        x = self.pd.prefill_instances
        with self._lock:
            if request_id in self._owner:
                raise ValueError(f"request_id {request_id!r} is already in flight.")
            index = self._route(lambda: self.pd_router.route_prefill(routed, self.loads[:x]))
            command = ("add", request_id, prompt, prefill_sampling_params(params),
                       {**kwargs, "kv_transfer_params": prefill_kv_transfer_params()})
            prefill = _PrefillSink(self, request_id, prompt, params, kwargs, routed, sink)
            self._queue(index, command, request_id, prefill, len(routed.prompt_token_ids))
            self._prefilling[request_id] = prefill
        return index

    def abort(self, request_id: str) -> None:
        with self._lock:
            prefill = self._prefilling.pop(request_id, None)
            if prefill is not None:
                prefill.aborted = True
        super().abort(request_id)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._prefilling.pop(request_id, None)

    @staticmethod
    def _route(route: Callable[[], int]) -> int:
        try:
            return route()
        except NoHealthyReplica as exc:
            raise EngineOverloaded(f"no instance can serve now: {exc}", "no_healthy_replica",
                                   ADMISSION_RETRY_AFTER_S) from exc

    def _start_decode(self, prefilled: _PrefillSink, kv_params: dict[str, Any]) -> None:
        """The prefill finished: the request goes to a decode instance with the producer's
        params (from the reader thread)."""
        x = self.pd.prefill_instances
        kwargs = {**prefilled.kwargs, "kv_transfer_params": kv_params}
        try:
            with self._lock:
                if prefilled.aborted:  # (the producer frees its blocks at its transfer timeout)
                    return
                self._prefilling.pop(prefilled.request_id, None)
                if prefilled.request_id in self._owner:
                    raise ValueError(f"request_id {prefilled.request_id!r} is already in flight.")
                index = x + self._route(lambda: self.pd_router.route_decode(
                    prefilled.routed, kv_params, self.loads[x:]))
                self._queue(index, ("add", prefilled.request_id, prefilled.prompt,
                                    prefilled.params, kwargs),
                            prefilled.request_id, _DecodeSink(prefilled.sink))
        except (EngineOverloaded, ValueError) as exc:
            prefilled.sink.put(exc)

    def take_instance_records(self) -> list[InstanceRecord]:
        """The records kept since the last call (empty unless ``record_instances``)."""
        with self._lock:
            if self._instance_records is None:
                return []
            taken = list(self._instance_records)
            self._instance_records.clear()
        return taken

    def _handle(self, event: ReplicaEvent) -> None:
        message = event.message
        if event.kind != "died" and message[0] == "ready" and len(message) == 3:
            with self._lock:  # (before the base marks it ready)
                self.origins[event.replica], self.instance_configs[event.replica] = message[1:]
        super()._handle(event)

    def _on_step(self, index: int, outputs: list[Any], accepted: list[str],
                 refused: list[Refusal], stats: SchedulerStats, kv_events: list[Any],
                 records: list[RequestRecord],
                 steps: Sequence[tuple[StepRecord, StepSample]] = (),
                 step_tokens: Sequence[int] = ()) -> None:
        if records and self._instance_records is not None:  # (before the outputs are delivered)
            origin = self.origins[index]
            with self._lock:
                self._instance_records.extend(InstanceRecord(index, on_monotonic(r, origin))
                                              for r in records)
        super()._on_step(index, outputs, accepted, refused, stats, kv_events, records, steps,
                         step_tokens)

    def _on_death(self, index: int, exitcode: int | None) -> None:
        super()._on_death(index, exitcode)
        x = self.pd.prefill_instances
        if index < x:
            self.pd_router.prefill.on_replica_reset(index)
        else:
            self.pd_router.decode.on_replica_reset(index - x)


@dataclass(slots=True)
class _PrefillSink:
    """Receives the prefill instance's items for one request and hands it to a decode instance."""

    front: DisaggregatedFront
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    kwargs: dict[str, Any]
    routed: Request
    sink: Sink
    aborted: bool = False

    def put(self, item: Any) -> None:
        if item is None:
            self.sink.put(item)  # accepted
            return
        if isinstance(item, BaseException):
            self.front._forget(self.request_id)
            self.sink.put(item)  # refused, or the instance died
            return
        if not item.finished:
            return
        kv_params = getattr(item, "kv_transfer_params", None)
        if kv_params is None or item.outputs[0].finish_reason not in ("stop", "length"):
            self.front._forget(self.request_id)
            self.sink.put(item)  # aborted, or ended with an error: nothing to decode
            return
        self.front._start_decode(self, kv_params)


@dataclass(slots=True)
class _DecodeSink:
    """The decode instance's items for the request's own sink (its acceptance was reported by
    the prefill instance already)."""

    sink: Sink

    def put(self, item: Any) -> None:
        if item is not None:
            self.sink.put(item)
