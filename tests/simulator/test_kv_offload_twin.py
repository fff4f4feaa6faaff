"""The host KV tier's twin worker (simulator/kv_offload.py): copies charged over the host link."""

from __future__ import annotations

import pytest

from twinserve.core.kv_offload import OffloadingConnectorMetadata
from twinserve.simulator.kv_offload import HostLink, TwinOffloadingWorker

MB = 1 << 20


def test_a_load_ends_after_latency_plus_bytes_over_bandwidth():
    worker = TwinOffloadingWorker(HostLink(100 * MB, 0.001), MB)
    worker.start(OffloadingConnectorMetadata(loads={"a": [(0, 1), (1, 2)]}), now=1.0)
    assert worker.next_event_time() == pytest.approx(1.021)
    assert worker.get_finished(1.02).finished_recving == set()
    assert worker.get_finished(1.021).finished_recving == {"a"}
    assert worker.next_event_time() is None


def test_loads_queue_on_their_direction_stores_on_the_other():
    worker = TwinOffloadingWorker(HostLink(100 * MB, 0.0), MB)
    meta = OffloadingConnectorMetadata(loads={"a": [(0, 0)] * 10, "b": [(1, 1)] * 10},
                                       stores=[(5, 5)] * 50)
    worker.start(meta, now=0.0)
    assert worker.get_finished(0.1).finished_recving == {"a"}  # b waits behind a
    assert worker.get_finished(0.2).finished_recving == {"b"}  # stores did not delay it
    assert worker.store_s == pytest.approx(0.5) and worker.load_s == pytest.approx(0.2)
    assert (worker.num_blocks_loaded, worker.num_blocks_stored) == (20, 50)


def test_a_cancelled_load_is_never_reported():
    worker = TwinOffloadingWorker(HostLink(100 * MB), MB)
    worker.start(OffloadingConnectorMetadata(loads={"a": [(0, 0)]}), now=0.0)
    worker.start(OffloadingConnectorMetadata(cancelled=["a"]), now=0.001)
    assert worker.get_finished(1.0).finished_recving == set()


def test_link_validation_names_the_field():
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        HostLink(0)
    with pytest.raises(ValueError, match="latency_s"):
        HostLink(1e9, -1)
    with pytest.raises(ValueError, match="bytes_per_block"):
        TwinOffloadingWorker(HostLink(1e9), 0)
