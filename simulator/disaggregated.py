"""The twin's disaggregated fleet (xPyD): X prefill and Y decode instances behind
``routers.DisaggregatedRouter``, KV moved between them as flows on a link (``kv_transfer``).

Each request runs as in the real deployment::

    arrival -> route_prefill -> prefill instance: max_tokens=1, {"do_remote_decode": True}
            -> its finishing output's kv_transfer_params -> route_decode -> decode instance
            -> WAITING_FOR_REMOTE_KVS: the load is a flow producer -> consumer
            -> last prompt token recomputed, first token sampled, decode to the trace's length

Every instance runs the shared scheduler with the Peer connector's scheduler side; the twin's
worker side (``kv_transfer.SimPeerWorker``) reports finished loads and sends through the seam. A
step with nothing scheduled but transfers pending costs no time: the instance waits for the next
arrival or transfer event. Instances step one at a time (no decode runs), so a P/D replay costs
more CPU per request than an aggregated one.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy

from twinserve.core.errors import EngineOverloaded
from twinserve.core.kv_connector import PeerConnectorScheduler
from twinserve.core.kv_transfer_config import KVTransferConfig
from twinserve.core.metrics import RequestRecord, summarize
from twinserve.core.outputs import EngineCoreOutput, ModelRunnerOutput
from twinserve.core.request import Request
from twinserve.core.run_dir import DisaggregatedParts
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import Scheduler
from twinserve.core.step_driver import RunRecorder, StepDriver
from twinserve.policies import get_policy
from twinserve.routers import ReplicaLoad
from twinserve.routers.disaggregated import (
    DisaggregatedRouter,
    prefill_kv_transfer_params,
    prefill_sampling_params,
)
from twinserve.simulator.engine import SyntheticTokens, rejected_record
from twinserve.simulator.kv_transfer import LinkNetwork, LinkSpec, SimPeerWorker
from twinserve.simulator.step_time import StepTimeModel

if TYPE_CHECKING:
    from twinserve.simulator.run import EngineBuild, SimConfig, SimResult
    from twinserve.traces import TraceRequest


@dataclass(slots=True)
class Instance:
    """One simulated engine of a pool: its driver, worker side, step time and busy seconds."""

    pool: str  # "prefill" or "decode"
    index: int  # within its pool
    driver: StepDriver
    cost: StepTimeModel
    worker: SimPeerWorker | None = None
    tokens: SyntheticTokens = field(default_factory=SyntheticTokens)
    wakeup: simpy.Event | None = None
    busy_s: float = 0.0

    def __post_init__(self) -> None:
        self.driver.on_release = self.tokens.release

    @property
    def engine_id(self) -> str:
        return f"{self.pool}-{self.index}"

    @property
    def scheduler(self) -> Scheduler:
        return self.driver.scheduler

    def load(self) -> ReplicaLoad:
        s = self.scheduler
        return ReplicaLoad(len(s.running), s.num_waiting + len(s.waiting_for_remote), s.kv.usage)

    def wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.triggered:
            self.wakeup.succeed()

    def add(self, request: Request) -> None:
        self.driver.add_request(request)
        self.tokens.admit(request.request_id)
        self.wake()


def instance_process(env: simpy.Environment, inst: Instance, on_outputs):
    """One instance's loop: schedule, orders to the worker side, the step's time (none when
    nothing was scheduled), then the step's results with the worker's report."""
    sched, worker = inst.scheduler, inst.worker
    assert worker is not None
    complete, step_time, sampled = inst.driver.completer(), inst.cost.step_time, inst.tokens.output
    while True:
        start = env.now
        out = sched.schedule(start)
        worker.start(out.kv_connector_metadata)  # type: ignore[arg-type]
        if out.scheduled:
            duration = step_time(out)
            worker.step_started()
            yield env.timeout(duration)
            worker.step_ended()
            inst.busy_s += duration
        report = worker.get_finished()
        result = ModelRunnerOutput(sampled.sampled_token_ids, kv_connector_output=report)
        outputs = complete(out, result, start, env.now)
        if outputs:
            on_outputs(inst, outputs)
        if not (out.scheduled or out.preempted_request_ids or report or worker.has_news):
            inst.wakeup = env.event()  # idle: until an arrival or a transfer event
            yield inst.wakeup
            inst.wakeup = None


@dataclass(slots=True)
class Fleet:
    """The two pools, the router and each request's P/D bookkeeping for one replay."""

    env: simpy.Environment
    prefill: list[Instance]
    decode: list[Instance]
    router: DisaggregatedRouter
    recorder: RunRecorder
    parts: dict[str, DisaggregatedParts] = field(default_factory=dict)
    originals: dict[str, Request] = field(default_factory=dict)  # until handed to decode
    producers: dict[str, Request] = field(default_factory=dict)  # until the prefill finishes
    _prefill_params: dict[int, SamplingParams] = field(default_factory=dict)

    def arrivals(self, requests: Iterable[Request]):
        env = self.env
        for request in requests:
            delay = request.arrival_time - env.now
            if delay > 0:
                yield env.timeout(delay)
            self.start(request)

    def start(self, request: Request) -> None:
        """Sends the request's prefill to the prefill instance the router picks."""
        rid = request.request_id
        inst = self.prefill[self.router.route_prefill(request, [i.load() for i in self.prefill])]
        params = self._prefill_params.get(id(request.sampling_params))
        if params is None:
            params = self._prefill_params[id(request.sampling_params)] = \
                prefill_sampling_params(request.sampling_params)
        producer = Request(rid, request.prompt_token_ids, params, request.arrival_time,
                           priority=request.priority, tenant=request.tenant, lora=request.lora,
                           hints=request.hints, kv_transfer_params=prefill_kv_transfer_params())
        self.parts[rid] = DisaggregatedParts(inst.engine_id, arrival=request.arrival_time)
        try:
            inst.add(producer)
        except (ValueError, EngineOverloaded) as exc:
            self.recorder.requests.append(rejected_record(request, str(exc)))
            return
        self.originals[rid] = request
        self.producers[rid] = producer

    def on_outputs(self, inst: Instance, outputs: list[EngineCoreOutput]) -> None:
        if inst.pool == "prefill":
            for o in outputs:
                if o.finished:
                    self.hand_over(o)

    def hand_over(self, output: EngineCoreOutput) -> None:
        """A finished prefill: its request goes to a decode instance with the producer's params."""
        rid = output.request_id
        producer, request = self.producers.pop(rid), self.originals.pop(rid)
        part = self.parts[rid]
        part.prefill_start = _time(producer.first_scheduled_time)
        part.prefill_done = _time(producer.finish_time)
        if output.kv_transfer_params is None:
            self.recorder.requests.append(rejected_record(
                request, output.error or f"the prefill ended ({output.finish_reason}) without KV"))
            return
        index = self.router.route_decode(request, output.kv_transfer_params,
                                         [i.load() for i in self.decode])
        inst = self.decode[index]
        part.decode_engine = inst.engine_id
        request.kv_transfer_params = output.kv_transfer_params
        try:
            inst.add(request)
        except (ValueError, EngineOverloaded) as exc:
            self.recorder.requests.append(rejected_record(request, str(exc)))

    def collect_loads(self) -> None:
        """Each request's load times and bytes, from its decode instance's worker side."""
        for inst in self.decode:
            assert inst.worker is not None
            for rid, load in inst.worker.loads.items():
                part = self.parts[rid]
                part.load_start, part.load_end, part.kv_transfer_bytes = \
                    load.start, load.end, load.num_bytes


def _time(value: float | None) -> float:
    return math.nan if value is None else value


def build_fleet(env: simpy.Environment, cfg: SimConfig, pools_cfg: Mapping[str, tuple[Any, StepTimeModel]],
                link: LinkSpec, block_bytes: float, recorder: RunRecorder) -> Fleet:
    """The X prefill and Y decode instances, each with the Peer connector on both sides;
    ``pools_cfg``: each pool's scheduler configuration and step-time model."""
    kv_cfg = cfg.engine.kv_transfer_config
    failure = kv_cfg.kv_load_failure_policy if isinstance(kv_cfg, KVTransferConfig) else "recompute"
    timeout = kv_cfg.transfer_timeout_s if isinstance(kv_cfg, KVTransferConfig) else 30.0
    network = LinkNetwork(env, link)
    peers: dict[str, SimPeerWorker] = {}
    prefill_steps = RunRecorder(steps=recorder.steps, record_requests=False,
                                record_tenants=recorder.record_tenants)
    pools: dict[str, list[Instance]] = {"prefill": [], "decode": []}
    counts = {"prefill": cfg.prefill_instances, "decode": cfg.decode_instances}
    for pool, n in counts.items():
        args, (sched_cfg, cost) = cfg.pool_engine(pool), pools_cfg[pool]
        for i in range(n):
            replica = i if pool == "prefill" else cfg.prefill_instances + i
            role = "kv_producer" if pool == "prefill" else "kv_consumer"
            kv = KVTransferConfig(kv_role=role, engine_id=f"{pool}-{i}",
                                  kv_load_failure_policy=failure,
                                  kv_connector_extra_config={"transfer_timeout_s": timeout})
            sched = Scheduler(sched_cfg, get_policy(args.scheduling_policy, **args.policy_options),
                              stream_outputs=False,
                              kv_connector=PeerConnectorScheduler(kv, sched_cfg.block_size))
            inst = Instance(pool, i, StepDriver(sched, prefill_steps if pool == "prefill"
                                                else recorder, replica), cost)
            inst.worker = SimPeerWorker(inst.engine_id, network, peers, block_bytes, timeout,
                                        inst.wake)
            pools[pool].append(inst)
    router = DisaggregatedRouter.of(cfg.prefill_instances, cfg.decode_instances,
                                    cfg.engine.block_size)
    return Fleet(env, pools["prefill"], pools["decode"], router, recorder)


def replay_fleet(cfg: SimConfig, requests: Iterator[Request], record_tenants: bool = False,
                 stop_when: Callable[[Sequence[RequestRecord]], bool] | None = None,
                 ) -> tuple[Fleet, EngineBuild, LinkSpec]:
    """Replays ``requests`` (in arrival order) through the xPyD fleet of ``cfg``; returns the
    fleet after the run (its schedulers, for audits), the engine build and the link.
    ``stop_when``: as ``simulate``'s (asked with the requests finished so far)."""
    from twinserve.simulator.run import (  # (run.py dispatches here)
        SimConfig,
        _stopper,
        build_engine_config,
    )
    build = build_engine_config(cfg)
    engine_config, cost = build.engine_config, build.cost_model
    link = cost.hardware.kv_link_spec(cfg.kv_link)
    if link.cpu_consumer and cost.hardware.device_type != "cpu":
        raise ValueError(f"kv_link.first_touch_s_per_byte and consumer_step_share describe a "
                         f"consumer on a CPU; profile {cost.hardware.name!r} runs on "
                         f"{cost.hardware.device_type} (remove them from its kv_link).")
    pools_cfg = {}
    for pool in ("prefill", "decode"):  # a pool with its own arguments: its own resolution
        own = build if not getattr(cfg, f"{pool}_args") else build_engine_config(
            SimConfig(cfg.pool_engine(pool), hardware=cfg.hardware, usage_context=cfg.usage_context))
        pools_cfg[pool] = (own.engine_config.scheduler, own.cost_model)
    env = simpy.Environment()
    fleet = build_fleet(env, cfg, pools_cfg, link, engine_config.block_bytes,
                        RunRecorder(record_tenants=record_tenants))
    env.process(fleet.arrivals(requests))
    for inst in fleet.prefill + fleet.decode:
        env.process(instance_process(env, inst, fleet.on_outputs))
    if stop_when is not None:
        fleet.recorder.on_finish = _stopper(env, fleet.recorder, stop_when, None)
    env.run()
    fleet.collect_loads()
    return fleet, build, link


def simulate_disaggregated(cfg: SimConfig, trace: list[TraceRequest], requests: Iterator[Request],
                           stop_when: Callable[[Sequence[RequestRecord]], bool] | None = None,
                           ) -> SimResult:
    """``simulate`` for an xPyD fleet: the run's records are the decode side's (a request's
    arrival is its arrival at the front), its summary adds ``pool_summary``."""
    from twinserve.simulator.run import SimResult
    t0 = time.perf_counter()
    fleet, build, link = replay_fleet(cfg, requests, len({tr.tenant for tr in trace}) > 1,
                                      stop_when)
    recorder = fleet.recorder
    recorder.steps.sort_by_time()
    records = sorted(recorder.requests, key=lambda r: (r.arrival_time, r.request_id))
    duration = max((r.finish_time for r in records if r.success), default=0.0)
    summary = summarize(records, duration_s=duration or None)
    summary.update(pool_summary(fleet, records, duration, link))
    return SimResult(cfg, build.engine_config, records, recorder.steps, summary,
                     time.perf_counter() - t0, build.cost_model.describe(),
                     disaggregated=fleet.parts)


def pool_summary(fleet: Fleet, records: list[RequestRecord], duration: float,
                 link: LinkSpec) -> dict[str, Any]:
    """Per-pool utilisation (busy seconds over the run), KV transfer times and the TTFT parts,
    in ms (means; p90 for the transfer)."""
    # the link's own fields, those at their defaults left out (LinkSpec.to_dict)
    out: dict[str, Any] = {"kv_link": link.name, **{
        f"kv_link_{key}": value for key, value in link.to_dict().items()
        if key not in ("name", "source")}}
    for name, pool in (("prefill", fleet.prefill), ("decode", fleet.decode)):
        out[f"{name}_instances"] = len(pool)
        out[f"{name}_utilization"] = (statistics.fmean(i.busy_s for i in pool) / duration
                                      if duration > 0 else 0.0)
    loads = [p for p in fleet.parts.values() if not math.isnan(p.load_end)]
    times = sorted((p.load_end - p.load_start) * 1e3 for p in loads)
    out["num_kv_transfers"] = len(times)
    out["kv_transfer_bytes"] = int(sum(p.kv_transfer_bytes for p in loads))
    out["mean_kv_transfer_ms"] = statistics.fmean(times) if times else 0.0
    out["p90_kv_transfer_ms"] = float(np.percentile(times, 90)) if times else 0.0
    rows = [fleet.parts[r.request_id].row(r.first_token_time) for r in records
            if r.success and r.request_id in fleet.parts]
    for k, part in enumerate(("queue", "prefill", "transfer", "decode")):
        values = [row[4 + k] * 1e3 for row in rows]
        out[f"mean_ttft_{part}_ms"] = statistics.fmean(values) if values else 0.0
    return out
