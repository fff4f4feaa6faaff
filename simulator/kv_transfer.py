"""The twin's KV transfers: links, a fluid flow model with max-min fair sharing, and the Peer
connector's worker side that runs each load as a flow.

A transfer of ``bytes`` from instance S to instance R takes ``latency_s`` and then flows at a
rate the link shares among the flows active at that moment: every instance has one link of
``bandwidth_bytes_per_s`` per direction (egress for what it sends, ingress for what it
receives), and no flow goes faster than ``flow_bandwidth_bytes_per_s`` (one copy thread, one
queue pair: by default the link's bandwidth, a flow alone fills the link). The rates are max-min
fair (progressive filling: each flow gets the smaller of its cap and its fair share of the most
contended link it crosses; what capped or bottlenecked flows leave goes to the others), as in
flow-level network and NVLink models. Rates change only when a flow starts or ends, so the model
moves from one such event to the next. One flow alone therefore takes ``latency_s + bytes /
flow_bandwidth``; ``c`` flows from one sender each take ``max(1, c * flow_bandwidth /
bandwidth)`` times its bandwidth term. A link may also charge each transfer ``overhead_s`` of
work that is shared like its bytes (a flow carries ``bytes + overhead_s * flow_bandwidth``): the
fixed cost of a connector whose handshake runs on the same contended CPU as its copy, where
concurrent transfers do not overlap their fixed costs (measured on this machine's Peer
connector: ``benchmarks/kv_link_fit.py``). Anchors: DistServe's and splitwise-sim's transfer
models (bandwidth and latency), with contention as in flow-level network simulators.

A consumer on a CPU (``SimPeerWorker``) adds two rules, both measured on this machine
(``gpu.measurement.kv_transfer.measure_consumer``) and off by default (a GPU's DMA engines copy
beside compute into memory allocated up front):
- ``first_touch_s_per_byte``: a load into local blocks that no load wrote before pays this per
  byte of them, as work shared like its bytes: a CPU region's pages are allocated at their
  first write (page faults, zero-filling), which a long-running server paid once and a fresh
  deployment pays on its first pass over the cache.
- ``consumer_step_share``: while the consumer instance is inside a step, its loads move at most
  this share of a lone flow's rate: the load thread and the step share the instance's one core
  (and Python's lock).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import simpy

from twinserve.core.kv_connector import KVConnectorOutput, KVLoad, PeerConnectorMetadata
from twinserve.core.kv_link import LinkSpec

GB = 1e9
_EPS_BYTES = 1e-6  # a flow with less left than this has finished (float residue of rate * dt)


_NVLINK4 = "NVLink 4: 900 GB/s bidirectional per GPU (NVIDIA H100/H200 datasheets)"
_NVLINK3 = "NVLink 3: 600 GB/s bidirectional per GPU (NVIDIA A100 datasheet)"
_NDR = "InfiniBand NDR: 400 Gb/s per GPU (ConnectX-7, one NIC per GPU as in DGX H100)"
_HDR = "InfiniBand HDR: 200 Gb/s per GPU (ConnectX-6, one NIC per GPU as in DGX A100)"
_GEN5 = "PCIe Gen5 x16: 64 GB/s raw per direction, ~50 GB/s effective (assumed 78%)"
_GEN4 = "PCIe Gen4 x16: 32 GB/s raw per direction, ~25 GB/s effective (assumed 78%)"
# Latencies are assumed, not measured: NVLink a few microseconds, RDMA over InfiniBand ~10 us
# with the connector's handshake, a PCIe bounce through host memory more.
_PRESETS: Mapping[str, Mapping[str, tuple[float, float, str]]] = {
    "hopper": {"nvlink": (450 * GB, 5e-6, _NVLINK4), "infiniband": (50 * GB, 10e-6, _NDR),
               "pcie": (50 * GB, 20e-6, _GEN5)},
    "ampere": {"nvlink": (300 * GB, 5e-6, _NVLINK3), "infiniband": (25 * GB, 10e-6, _HDR),
               "pcie": (25 * GB, 20e-6, _GEN4)},
}
LINK_NAMES = ("nvlink", "infiniband", "pcie")


def _generation(profile_name: str) -> str | None:
    name = profile_name.lower()  # a bundled name, or a device's ("NVIDIA H100 80GB HBM3")
    if "h100" in name or "h200" in name:
        return "hopper"
    if "a100" in name:
        return "ampere"
    return None


def link_presets(profile_name: str) -> dict[str, LinkSpec]:
    """The bundled links of a hardware profile's GPU (empty for a device without presets)."""
    gen = _generation(profile_name)
    if gen is None:
        return {}
    return {name: LinkSpec(name, bw, lat, src) for name, (bw, lat, src) in _PRESETS[gen].items()}


def resolve_link(profile_name: str, kv_link: str | None,
                 measured: Mapping[str, Any] | None = None) -> LinkSpec:
    """The link a run uses: ``kv_link`` by name ("measured": the profile's calibrated
    ``kv_link``); None: the calibrated link when the profile has one, else NVLink."""
    presets = link_presets(profile_name)
    if measured is not None:
        presets["measured"] = LinkSpec.from_dict(measured)
    if kv_link is None:
        kv_link = "measured" if measured is not None else "nvlink"
    link = presets.get(kv_link)
    if link is None:
        valid = ", ".join(presets) or "none (calibrate the profile's kv_link)"
        raise ValueError(f"kv_link {kv_link!r} is not known for hardware {profile_name!r}; "
                         f"valid: {valid}.")
    return link


@dataclass(slots=True, eq=False)
class Flow:
    """A transfer in the fluid model. ``done`` fires with True when the last byte arrived."""

    src: str
    dst: str
    remaining: float
    done: simpy.Event
    rate: float = 0.0
    active: bool = False  # past its latency, sharing the links


@dataclass(slots=True)
class LinkNetwork:
    """Flows between instances, each instance with one ``link`` per direction, shared max-min
    fairly. ``transfer`` returns an event that fires when the flow completes. ``pace``: per
    receiving instance, the share of a flow's cap its flows keep now (``set_pace``)."""

    env: simpy.Environment
    link: LinkSpec
    flows: list[Flow] = field(default_factory=list)
    pace: dict[str, float] = field(default_factory=dict)
    _last: float = 0.0
    _generation: int = 0

    def transfer(self, src: str, dst: str, num_bytes: float, work_s: float = 0.0) -> Flow:
        """A flow of ``num_bytes``, plus the link's overhead and ``work_s`` more seconds of
        work at a lone flow's rate (both shared like bytes)."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}.")
        if work_s < 0:
            raise ValueError(f"work_s must be >= 0, got {work_s}.")
        carried = float(num_bytes) + self.link.overhead_bytes + work_s * self.link.flow_rate
        flow = Flow(src, dst, carried, self.env.event())
        self.env.process(self._start(flow))
        return flow

    def set_pace(self, dst: str, share: float) -> None:
        """From now on, flows into ``dst`` move at most ``share`` of a flow's cap."""
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share!r}.")
        if self.pace.get(dst, 1.0) == share:
            return
        if not any(f.dst == dst for f in self.flows):  # no rate changes (a producer's steps)
            self.pace[dst] = share
            return
        self._advance()
        self.pace[dst] = share
        self._reschedule()

    def cancel(self, flow: Flow) -> None:
        """Drops a flow (its ``done`` never fires); the others get its share."""
        if flow in self.flows:
            self._advance()
            self.flows.remove(flow)
            self._reschedule()
        flow.active = False
        flow.remaining = -1.0  # marks a flow cancelled during its latency

    def _start(self, flow: Flow):
        if self.link.latency_s:
            yield self.env.timeout(self.link.latency_s)
        if flow.remaining < 0:  # cancelled meanwhile
            return
        self._advance()
        flow.active = True
        self.flows.append(flow)
        self._reschedule()

    def _advance(self) -> None:
        """Moves every active flow forward to now at its current rate."""
        dt = self.env.now - self._last
        if dt > 0:
            for flow in self.flows:
                flow.remaining -= flow.rate * dt
        self._last = self.env.now

    def _reschedule(self) -> None:
        """Finishes drained flows, recomputes the fair rates, and sets one timer for the next
        completion (older timers see a stale generation and do nothing)."""
        finished = [f for f in self.flows if f.remaining <= _EPS_BYTES]
        if finished:
            self.flows = [f for f in self.flows if f.remaining > _EPS_BYTES]
            for f in finished:
                f.active = False
                f.done.succeed(True)
        max_min_rates(self.flows, self.link.bandwidth_bytes_per_s, self.link.flow_rate, self.pace)
        self._generation += 1
        if self.flows:
            wait = min(f.remaining / f.rate for f in self.flows)
            self.env.process(self._timer(wait, self._generation))

    def _timer(self, wait: float, generation: int):
        yield self.env.timeout(wait)
        if generation == self._generation:
            self._advance()
            for f in self.flows:  # the flow(s) the timer was set for end now, exactly
                if f.remaining <= f.rate * 1e-12 + _EPS_BYTES:
                    f.remaining = 0.0
            self._reschedule()


def max_min_rates(flows: list[Flow], capacity: float, flow_cap: float = math.inf,
                  pace: Mapping[str, float] | None = None) -> None:
    """Sets each flow's rate, max-min fair over the egress link of its sender and the ingress
    link of its receiver, each of ``capacity``, no flow above its cap (``flow_cap`` times its
    receiver's ``pace``, 1 if absent). Progressive filling: all rates rise together; a port
    that fills fixes its flows at their equal share, a flow that reaches its cap stays there."""
    pace = pace or {}
    left: dict[tuple[str, str], float] = {}
    users: dict[tuple[str, str], list[Flow]] = {}
    for f in flows:
        for port in (("out", f.src), ("in", f.dst)):
            left[port] = capacity
            users.setdefault(port, []).append(f)
    cap = {id(f): flow_cap * pace.get(f.dst, 1.0) for f in flows}
    unfixed = {id(f): f for f in flows}
    while unfixed:
        # the bottleneck: the port whose unfixed flows get the least by sharing it equally
        share, port = min((left[p] / n, p) for p, fs in users.items()
                          if (n := sum(1 for f in fs if id(f) in unfixed)))
        capped = [f for f in unfixed.values() if cap[id(f)] <= share]
        # flows capped below the bottleneck's share stay capped (shares only grow as they go)
        fixed = [(f, cap[id(f)]) for f in capped] or \
            [(f, share) for f in users[port] if id(f) in unfixed]
        for f, rate in fixed:
            f.rate = rate
            del unfixed[id(f)]
            for p in (("out", f.src), ("in", f.dst)):
                left[p] -= rate


@dataclass(slots=True)
class LoadTimes:
    """One load as the twin ran it: when it started and ended, and its bytes."""

    start: float
    end: float = math.nan
    num_bytes: float = 0.0


class SimPeerWorker:
    """The Peer connector's worker side in the twin: each ``KVLoad`` is a flow from the
    producer's instance to this one (its bytes: the blocks times ``block_bytes``, the KV of a
    block on the whole instance). A producer keeps a send published until its reader is done or
    ``timeout_s`` passes; a consumer's load that outlasts ``timeout_s`` fails. The link's CPU
    consumer rules: ``step_started``/``step_ended`` pace this instance's loads, and ``touched``
    holds the local blocks loads wrote (only loads count: a block a step wrote first, then a
    load, is charged as fresh, which happens once a run wraps around the cache)."""

    def __init__(self, engine_id: str, network: LinkNetwork, peers: dict[str, SimPeerWorker],
                 block_bytes: float, timeout_s: float, wake: Callable[[], None]) -> None:
        self.engine_id, self.network, self.peers = engine_id, network, peers
        self.block_bytes, self.timeout_s, self.wake = block_bytes, timeout_s, wake
        peers[engine_id] = self
        self.flows: dict[str, tuple[Flow, KVLoad]] = {}
        self.published: set[str] = set()
        self.released_early: set[str] = set()
        self.expired: set[str] = set()  # sends freed by their timeout: nothing left to read
        self.loads: dict[str, LoadTimes] = {}  # every load this instance ran, by request id
        self.touched: set[int] = set()
        self._report = KVConnectorOutput()

    def start(self, meta: PeerConnectorMetadata) -> None:
        env = self.network.env
        for rid in meta.sends:
            if rid in self.released_early:  # read before this instance published it
                self.released_early.discard(rid)
                self._report.finished_sending.add(rid)
            else:
                self.published.add(rid)
                env.process(self._send_timeout(rid))
        for load in meta.loads:
            if not load.local_block_ids:
                self.peers[load.remote_engine_id].release(load.remote_request_id)
                continue
            if load.remote_request_id in self.peers[load.remote_engine_id].expired:
                self._report.failed_recving.add(load.request_id)  # the producer gave up on it
                continue
            num_bytes = len(load.local_block_ids) * self.block_bytes
            flow = self.network.transfer(load.remote_engine_id, self.engine_id, num_bytes,
                                         self._first_touch_s(load.local_block_ids))
            self.flows[load.request_id] = (flow, load)
            self.loads[load.request_id] = LoadTimes(env.now, num_bytes=num_bytes)
            env.process(self._receive(load.request_id, flow))
        for rid in meta.cancelled:
            self._drop(rid)

    def _first_touch_s(self, block_ids: list[int]) -> float:
        per_byte = self.network.link.first_touch_s_per_byte
        if not per_byte:
            return 0.0
        fresh = len(set(block_ids) - self.touched)
        self.touched.update(block_ids)
        return fresh * self.block_bytes * per_byte

    def step_started(self) -> None:
        """This instance begins a step: its loads slow to the link's ``consumer_step_share``."""
        share = self.network.link.consumer_step_share
        if share < 1:
            self.network.set_pace(self.engine_id, share)

    def step_ended(self) -> None:
        if self.network.link.consumer_step_share < 1:
            self.network.set_pace(self.engine_id, 1.0)

    def _receive(self, rid: str, flow: Flow):
        env = self.network.env
        result = yield flow.done | env.timeout(self.timeout_s)
        if self.flows.get(rid, (None,))[0] is not flow:  # cancelled meanwhile
            return
        _, load = self.flows.pop(rid)
        self.peers[load.remote_engine_id].release(load.remote_request_id)
        if flow.done in result:
            self.loads[rid].end = env.now
            self._report.finished_recving.add(rid)
        else:
            self.network.cancel(flow)
            self._report.failed_recving.add(rid)
        self.wake()

    def _send_timeout(self, rid: str):
        yield self.network.env.timeout(self.timeout_s)
        if rid in self.published:  # nobody read it in time
            self.expired.add(rid)
            self.release(rid)

    def _drop(self, rid: str) -> None:
        entry = self.flows.pop(rid, None)
        if entry is not None:
            flow, load = entry
            self.network.cancel(flow)
            self.peers[load.remote_engine_id].release(load.remote_request_id)

    def release(self, rid: str) -> None:
        """The reader is done with a published request (or gave up), or its send timed out."""
        if rid in self.published:
            self.published.discard(rid)
            self._report.finished_sending.add(rid)
            self.wake()
        elif rid not in self._report.finished_sending:
            self.released_early.add(rid)

    @property
    def has_news(self) -> bool:
        return bool(self._report)

    def get_finished(self) -> KVConnectorOutput:
        report, self._report = self._report, KVConnectorOutput()
        return report

    def close(self) -> None:
        for rid in list(self.flows):
            self._drop(rid)


def concurrent_load_seconds(link: LinkSpec, num_bytes: float, concurrency: int) -> list[float]:
    """What a P/D replay charges ``concurrency`` loads of ``num_bytes`` each that one decode
    instance starts at the same moment from one prefill instance: each load's seconds, start to
    end, run through the twin's own path (``SimPeerWorker`` over a ``LinkNetwork``)."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}.")
    if not 0 < num_bytes < math.inf:
        raise ValueError(f"num_bytes must be a positive number, got {num_bytes!r}.")
    env = simpy.Environment()
    network = LinkNetwork(env, link)
    peers: dict[str, SimPeerWorker] = {}
    horizon = 3600.0  # no timeout within reach: every load must finish
    producer = SimPeerWorker("producer", network, peers, num_bytes, horizon, lambda: None)
    consumer = SimPeerWorker("consumer", network, peers, num_bytes, horizon, lambda: None)
    rids = [f"load-{i}" for i in range(concurrency)]
    consumer.touched.update(range(concurrency))  # (measured loads write pages touched before)
    producer.start(PeerConnectorMetadata(sends={rid: [i] for i, rid in enumerate(rids)}))
    consumer.start(PeerConnectorMetadata(loads=[
        KVLoad(rid, "producer", rid, [i], [i], "127.0.0.1", 0) for i, rid in enumerate(rids)]))
    env.run(until=horizon)
    ends = [consumer.loads[rid].end - consumer.loads[rid].start for rid in rids]
    if not all(math.isfinite(t) for t in ends):
        raise ValueError(f"num_bytes: {concurrency} loads of {num_bytes} bytes do not finish "
                         f"within {horizon} s on link {link.name!r}.")
    return ends
