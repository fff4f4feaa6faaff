"""The twin's link with a shared per-transfer overhead, and the prediction path the measured
link is checked through (``concurrent_load_seconds``: SimPeerWorker loads over a LinkNetwork)."""

from __future__ import annotations

import pytest
import simpy

from twinserve.simulator.kv_transfer import LinkNetwork, LinkSpec, concurrent_load_seconds

LINK = LinkSpec("test", 100.0, 0.5)  # 100 bytes/s, half a second of latency


def test_one_load_takes_latency_plus_bytes_over_bandwidth() -> None:
    assert concurrent_load_seconds(LINK, 1000.0, 1) == [pytest.approx(10.5)]


def test_concurrent_loads_share_the_bandwidth_and_overlap_the_latency() -> None:
    assert concurrent_load_seconds(LINK, 1000.0, 2) == [pytest.approx(20.5)] * 2
    assert concurrent_load_seconds(LINK, 1000.0, 4) == [pytest.approx(40.5)] * 4


def test_an_overhead_is_shared_like_bytes() -> None:
    link = LinkSpec("cpu", 100.0, 0.5, overhead_s=2.0)  # 2 s of work: 200 bytes' worth
    assert concurrent_load_seconds(link, 1000.0, 1) == [pytest.approx(0.5 + 2.0 + 10.0)]
    assert concurrent_load_seconds(link, 1000.0, 3) == [pytest.approx(0.5 + 3 * 12.0)] * 3


def test_an_overhead_does_not_count_as_transferred_bytes() -> None:
    env = simpy.Environment()
    net = LinkNetwork(env, LinkSpec("cpu", 100.0, 0.0, overhead_s=1.0))
    flow = net.transfer("p", "d", 0.0)  # nothing to copy still pays the handshake
    env.run()
    assert flow.done.triggered and env.now == pytest.approx(1.0)


def test_overhead_round_trips_and_is_validated() -> None:
    link = LinkSpec.from_dict({"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4,
                               "overhead_s": 2e-4})
    assert link.overhead_s == 2e-4 and LinkSpec.from_dict(link.to_dict()) == link
    assert link.scaled(2).overhead_s == 2e-4 and link.scaled(2).overhead_bytes == pytest.approx(4e5)
    assert "overhead_s" not in LinkSpec("n", 1e9, 0.0).to_dict()  # files without one unchanged
    with pytest.raises(ValueError, match="overhead_s"):
        LinkSpec("n", 1e9, 0.0, overhead_s=-1.0)


def test_prediction_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        concurrent_load_seconds(LINK, 1000.0, 0)
    with pytest.raises(ValueError, match="num_bytes"):
        concurrent_load_seconds(LINK, 0.0, 1)
    with pytest.raises(ValueError, match="num_bytes"):  # beyond the horizon: refused, not silent
        concurrent_load_seconds(LinkSpec("slow", 1.0, 0.0), 1e6, 1)
