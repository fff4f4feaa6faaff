"""The host KV tier's worker side on the real engine (vLLM's OffloadingConnector)."""

from __future__ import annotations

from twinserve.core.kv_offload import OFFLOADING_CONNECTOR
from twinserve.core.kv_transfer_config import KVTransferConfig
from twinserve.gpu.kv_offload.worker import OffloadingConnectorWorker
from twinserve.gpu.worker.kv_cache import KVCache


def offloading_worker_for(config: KVTransferConfig | None, kv_cache: KVCache,
                          refusals: dict[str, bool]) -> OffloadingConnectorWorker | None:
    """The host tier's worker over ``kv_cache`` when ``config`` names the OffloadingConnector
    (None otherwise). ``refusals``: what the runner does that the tier does not support (name ->
    whether it is on), refused by name."""
    if config is None or config.kv_connector != OFFLOADING_CONNECTOR:
        return None
    on = [name for name, used in refusals.items() if used]
    if on:
        raise ValueError(f"kv_offloading_size with {', '.join(on)} is not implemented.")
    return OffloadingConnectorWorker(kv_cache.gpu_slots,
                                     config.kv_connector_extra_config["num_cpu_blocks"])
