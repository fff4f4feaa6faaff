"""The twin's link with a shared per-transfer overhead, and the prediction path the measured
link is checked through (``concurrent_load_seconds``: SimPeerWorker loads over a LinkNetwork)."""

from __future__ import annotations

import pytest
import simpy

from twinserve.simulator import SimConfig, simulate
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.kv_transfer import LinkNetwork, LinkSpec, concurrent_load_seconds
from twinserve.traces import SyntheticConfig, synthetic_trace

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


def test_a_calibrated_profile_carries_the_overhead_into_pd_runs(tmp_path) -> None:
    cpu = load_hardware("cpu")
    link = {"bandwidth_bytes_per_s": 5e9, "latency_s": 1e-4, "overhead_s": 3e-4}
    path = type(cpu).from_dict({**cpu.to_dict(), "kv_link": link}).save(tmp_path / "cpu.json")
    assert load_hardware(str(path)).kv_link_spec() == LinkSpec("measured", 5e9, 1e-4, "", 3e-4)
    trace = synthetic_trace(SyntheticConfig(num_requests=6, request_rate=5.0, input_len=64,
                                            output_len=4, seed=1))
    cfg = dict(model="smollm2-135m", hardware=str(path), prefill_instances=1, decode_instances=1)
    summary = simulate(SimConfig(**cfg), trace).summary
    assert summary["kv_link_overhead_s"] == 3e-4 and summary["num_kv_transfers"] == 6
    # every load pays the overhead on top of its latency and bytes
    assert summary["mean_kv_transfer_ms"] > 0.4
