"""``PeerConnectorWorker``: the Peer connector's worker side on the real engine.

Per step (``gpu/worker/model_runner.py``): ``start(meta)`` before the forward pass publishes the
producer's new sends, drops cancelled ones, and hands new loads to the consumer's background
threads (non-blocking); ``get_finished()`` after it reports what ended since. A producer also
reports a send nobody read within ``transfer_timeout_s`` as finished (its blocks are freed);
a consumer reports a load that failed or passed the timeout in ``failed_recving``.

Every engine with a Peer connector keeps its KV cache in a ``SharedKVRegion``; a producer
(``kv_producer``, ``kv_both``) also serves its side channel on ``kv_ip:kv_port``.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from twinserve.core.kv_connector import KVConnectorMetadata, KVConnectorOutput, PeerConnectorMetadata
from twinserve.core.kv_transfer_config import KVTransferConfig
from twinserve.core.request_output import KVLoadTiming
from twinserve.gpu.kv_transfer.consumer import Consumer, LoadJob, LoadResult
from twinserve.gpu.kv_transfer.producer import Producer
from twinserve.gpu.kv_transfer.region import KVLayout, SharedKVRegion
from twinserve.gpu.worker.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)

MAX_CONCURRENT_LOADS = 4


class PeerConnectorWorker:
    """The worker side of ``PeerConnector`` over this engine's ``region``."""

    def __init__(self, config: KVTransferConfig, region: SharedKVRegion) -> None:
        self.config = config
        self.region = region
        self._lock = threading.Lock()
        self._news = threading.Event()
        self._recved: set[str] = set()
        self._failed: set[str] = set()
        # finished loads, (request id, timing), taken by the engine (``take_records``)
        self.records: list[tuple[str, KVLoadTiming]] = []
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        if config.is_producer:
            self.producer = Producer(str(config.engine_id), region, config.kv_ip, config.kv_port,
                                     config.transfer_timeout_s)
        if config.is_consumer:
            self.consumer = Consumer(region.tensor, region.layout, MAX_CONCURRENT_LOADS,
                                     self._on_load)

    def start(self, meta: KVConnectorMetadata) -> None:
        if not isinstance(meta, PeerConnectorMetadata):
            raise ValueError(f"the PeerConnector's worker got {type(meta).__name__} orders.")
        now = time.monotonic()
        for rid in meta.cancelled:
            if self.consumer is not None:
                self.consumer.cancel(rid)  # returns once no copy into its blocks runs
            if self.producer is not None:
                self.producer.publications.cancel(rid)
        if meta.sends:
            if self.producer is None:
                raise ValueError("kv_transfer_params.do_remote_decode needs kv_role kv_producer "
                                 "or kv_both.")
            for rid, block_ids in meta.sends.items():
                self.producer.publications.publish(rid, block_ids, now)
        if meta.loads:
            if self.consumer is None:
                raise ValueError("kv_transfer_params.do_remote_prefill needs kv_role kv_consumer "
                                 "or kv_both.")
            deadline = now + self.config.transfer_timeout_s
            for load in meta.loads:
                self.consumer.submit(LoadJob(load.request_id, load.remote_request_id,
                                             load.remote_block_ids, load.local_block_ids,
                                             load.remote_host, load.remote_port, deadline))

    def _on_load(self, result: LoadResult) -> None:
        with self._lock:
            (self._recved if result.ok else self._failed).add(result.request_id)
            self.records.append((result.request_id, KVLoadTiming(
                result.start, result.end, result.num_bytes, result.ok)))
        if not result.ok:
            logger.warning("KV load of %s failed: %s", result.request_id, result.error)
        self._news.set()

    def get_finished(self) -> KVConnectorOutput:
        sent = (self.producer.publications.take_finished(time.monotonic())
                if self.producer is not None else set())
        with self._lock:
            self._news.clear()
            recved, self._recved = self._recved, set()
            failed, self._failed = self._failed, set()
        return KVConnectorOutput(sent, recved, failed)

    def wait(self, timeout_s: float) -> None:
        """Blocks until a load ends or ``timeout_s`` passes (a step with nothing to compute)."""
        self._news.wait(timeout_s)

    def take_records(self) -> list[tuple[str, KVLoadTiming]]:
        with self._lock:
            taken, self.records = self.records, []
        return taken

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        if self.producer is not None:
            self.producer.close()


def make_kv_connector_worker(config: KVTransferConfig, layout: KVLayout,
                             device: torch.device) -> PeerConnectorWorker:
    """The worker side named by ``config.kv_connector`` (this table is the real engine's)."""
    if config.kv_connector != "PeerConnector":
        raise ValueError(f"kv_transfer_config.kv_connector {config.kv_connector!r} has no worker "
                         "side in the real engine.")
    return PeerConnectorWorker(config, SharedKVRegion(layout, device))


def connector_for_runner(config: KVTransferConfig | None, spec: KVCacheSpec, num_slots: int,
                         num_blocks: int, device: torch.device,
                         refusals: dict[str, bool]) -> PeerConnectorWorker | None:
    """The runner's connector (None without a config); ``refusals``: what the engine runs that
    the connector cannot serve, by name (True: in use)."""
    if config is None:
        return None
    used = [name for name, on in refusals.items() if on]
    if used:
        raise ValueError(f"kv_transfer_config with {', '.join(used)} is not implemented.")
    return make_kv_connector_worker(config, KVLayout.of(spec, num_slots, num_blocks), device)
