"""The host KV tier's worker side in the twin: block copies charged over the host link.

The scheduler side is the engine's own (``core.kv_offload``); here only time is modelled. PCIe
is full duplex, so loads (host -> device) and stores (device -> host) each queue on their own
direction, first come first served: a transfer of ``n`` blocks starts when its direction is
free and takes ``latency + n * bytes_per_block / bandwidth``. Loads end when their last block
arrives (the request then rejoins the queue); stores cost no step time (the engine overlaps them
with the next forward pass) but hold their direction, as a real copy engine's queue does.
"""

from __future__ import annotations

import heapq

import simpy

from twinserve.core.kv_connector import KVConnectorMetadata, KVConnectorOutput
from twinserve.core.kv_offload import OffloadingConnectorMetadata
from twinserve.simulator.engine import Replica
from twinserve.simulator.hardware import HardwareProfile
from twinserve.simulator.kv_transfer import LinkSpec, link_presets

DEFAULT_LATENCY_S = 20e-6  # one DMA through host memory, as simulator.kv_transfer assumes


def transfer_s(link: LinkSpec, num_bytes: int) -> float:
    return link.latency_s + num_bytes / link.bandwidth_bytes_per_s


class TwinOffloadingWorker:
    """Times the host tier's copies. ``start(meta, now)`` before a step, ``get_finished(now)``
    after it; ``next_event_time()`` tells an idle engine when the next load ends."""

    def __init__(self, link: LinkSpec, bytes_per_block: int) -> None:
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}.")
        self.link = link
        self.bytes_per_block = bytes_per_block
        self._h2d_free = 0.0  # when each direction's queue drains
        self._d2h_free = 0.0
        self._loads: list[tuple[float, str]] = []  # heap of (end time, request id)
        self._cancelled: set[str] = set()
        self.load_s = 0.0  # link time spent, per direction
        self.store_s = 0.0
        self.num_blocks_loaded = 0
        self.num_blocks_stored = 0

    def start(self, meta: KVConnectorMetadata | None, now: float) -> None:
        if meta is None:
            return
        if not isinstance(meta, OffloadingConnectorMetadata):
            raise TypeError(f"the host tier's twin worker got {type(meta).__name__} orders.")
        self._cancelled.update(meta.cancelled)
        for rid, pairs in meta.loads.items():
            self._cancelled.discard(rid)
            took = transfer_s(self.link, len(pairs) * self.bytes_per_block)
            end = self._h2d_free = max(now, self._h2d_free) + took
            self.load_s += took
            self.num_blocks_loaded += len(pairs)
            heapq.heappush(self._loads, (end, rid))
        if meta.stores:
            took = transfer_s(self.link, len(meta.stores) * self.bytes_per_block)
            self._d2h_free = max(now, self._d2h_free) + took
            self.store_s += took
            self.num_blocks_stored += len(meta.stores)

    def get_finished(self, now: float) -> KVConnectorOutput:
        """The loads ended by ``now`` (a cancelled one is dropped silently)."""
        done: set[str] = set()
        loads = self._loads
        while loads and loads[0][0] <= now:
            _, rid = heapq.heappop(loads)
            if rid in self._cancelled:
                self._cancelled.discard(rid)
            else:
                done.add(rid)
        return KVConnectorOutput(set(), done, set())

    def next_event_time(self) -> float | None:
        return self._loads[0][0] if self._loads else None


def host_link_of(hardware: HardwareProfile) -> LinkSpec:
    """The profile's host link: its ``pcie_bandwidth`` (what its swap copies use too) and the
    PCIe preset's latency of its GPU generation (``simulator.kv_transfer``; else 20 us)."""
    preset = link_presets(hardware.name).get("pcie")
    latency = DEFAULT_LATENCY_S if preset is None else preset.latency_s
    return LinkSpec("pcie", hardware.pcie_bandwidth, latency,
                    f"{hardware.name} pcie_bandwidth; latency assumed")


def offloading_engine_process(env: simpy.Environment, replica: Replica, worker: TwinOffloadingWorker):
    """``engine.engine_process`` for a replica with the host tier: step by step (no decode runs:
    a connector's scheduler is never plainly decoding), the tier's copies started before each
    step and its loads collected after. A step with nothing to run while loads are in flight
    waits for the first to end or for an arrival, charging no step time."""
    driver, sched = replica.driver, replica.scheduler
    sampled = replica.tokens.output  # one output object, its connector report set per step
    step_time, complete = replica.cost.step_time, driver.completer()
    while True:
        if not sched.has_unfinished_requests():
            replica.wakeup = env.event()
            yield replica.wakeup
            replica.wakeup = None
        now = env.now
        out = sched.schedule(now)
        worker.start(out.kv_connector_metadata, now)
        if out.scheduled:
            yield env.timeout(step_time(out))
        elif not out.preempted_request_ids:  # (a step that only preempted: the next goes on)
            due = worker.next_event_time()
            if due is None:
                raise RuntimeError(f"replica {replica.index}: scheduler made no progress at t={now}")
            replica.wakeup = env.event()
            yield env.timeout(max(due - now, 0.0)) | replica.wakeup
            replica.wakeup = None
        sampled.kv_connector_output = worker.get_finished(env.now)
        complete(out, sampled, now, env.now)
