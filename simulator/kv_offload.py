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
from dataclasses import dataclass

from twinserve.core.kv_connector import KVConnectorMetadata, KVConnectorOutput
from twinserve.core.kv_offload import OffloadingConnectorMetadata

DEFAULT_LATENCY_S = 10e-6  # one DMA's set-up on PCIe: a few microseconds


@dataclass(slots=True, frozen=True)
class HostLink:
    """The device's host link (PCIe) for KV copies: bytes/s each way and a fixed latency per
    transfer."""

    bandwidth_bytes_per_s: float
    latency_s: float = DEFAULT_LATENCY_S

    def __post_init__(self) -> None:
        bw, lat = self.bandwidth_bytes_per_s, self.latency_s
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
            raise ValueError(f"bandwidth_bytes_per_s must be positive, got {bw!r}.")
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not lat >= 0:
            raise ValueError(f"latency_s must be >= 0, got {lat!r}.")

    def transfer_s(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


class TwinOffloadingWorker:
    """Times the host tier's copies. ``start(meta, now)`` before a step, ``get_finished(now)``
    after it; ``next_event_time()`` tells an idle engine when the next load ends."""

    def __init__(self, link: HostLink, bytes_per_block: int) -> None:
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

    def start(self, meta: KVConnectorMetadata, now: float) -> None:
        if not isinstance(meta, OffloadingConnectorMetadata):
            raise TypeError(f"the host tier's twin worker got {type(meta).__name__} orders.")
        self._cancelled.update(meta.cancelled)
        for rid, pairs in meta.loads.items():
            self._cancelled.discard(rid)
            took = self.link.transfer_s(len(pairs) * self.bytes_per_block)
            end = self._h2d_free = max(now, self._h2d_free) + took
            self.load_s += took
            self.num_blocks_loaded += len(pairs)
            heapq.heappush(self._loads, (end, rid))
        if meta.stores:
            took = self.link.transfer_s(len(meta.stores) * self.bytes_per_block)
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
