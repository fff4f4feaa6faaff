"""A link whose flows are capped below its capacity (one copy thread, one queue pair): max-min
fair shares where a flow's cap, a link's capacity, or both bind."""

from __future__ import annotations

import pytest
import simpy

from twinserve.simulator.kv_transfer import Flow, LinkSpec, concurrent_load_seconds, max_min_rates

# a link of 100 bytes/s, each flow at most 40: one flow alone moves 40, three share 100
CAPPED = LinkSpec("capped", 100.0, 0.0, flow_bandwidth_bytes_per_s=40.0)


def _flows(*pairs: tuple[str, str]) -> list[Flow]:
    env = simpy.Environment()
    return [Flow(src, dst, 1.0, env.event()) for src, dst in pairs]


def test_the_flow_cap_binds_when_the_link_has_room() -> None:
    flows = _flows(("p0", "d0"), ("p0", "d1"))  # fair share 50 each, cap 40
    max_min_rates(flows, 100.0, 40.0)
    assert [f.rate for f in flows] == [40.0, 40.0]


def test_the_capacity_binds_when_flows_outnumber_it() -> None:
    flows = _flows(("p0", "d0"), ("p0", "d1"), ("p0", "d2"), ("p0", "d3"))  # 25 each < 40
    max_min_rates(flows, 100.0, 40.0)
    assert [f.rate for f in flows] == [25.0] * 4


def test_capped_and_bottlenecked_flows_mix() -> None:
    # d0's ingress holds three flows (100 / 3 each, under the cap); p1 sends one more flow to d1,
    # whose fair share of p1's egress (100 - 33.3) is above the cap: it gets 40
    flows = _flows(("p0", "d0"), ("p1", "d0"), ("p2", "d0"), ("p1", "d1"))
    max_min_rates(flows, 100.0, 40.0)
    assert [f.rate for f in flows] == [pytest.approx(100 / 3)] * 3 + [40.0]
    # without the cap p1's second flow takes all p1 has left
    max_min_rates(flows, 100.0)
    assert flows[3].rate == pytest.approx(200 / 3)


def test_loads_take_the_capped_rate_then_share_the_capacity() -> None:
    assert concurrent_load_seconds(CAPPED, 400.0, 1) == [pytest.approx(10.0)]  # 400 / 40
    assert concurrent_load_seconds(CAPPED, 400.0, 2) == [pytest.approx(10.0)] * 2  # 80 < 100
    assert concurrent_load_seconds(CAPPED, 400.0, 4) == [pytest.approx(16.0)] * 4  # 25 each


def test_the_overhead_is_priced_at_a_lone_flows_rate() -> None:
    link = LinkSpec("capped", 100.0, 0.0, overhead_s=1.0, flow_bandwidth_bytes_per_s=40.0)
    assert link.overhead_bytes == pytest.approx(40.0)
    assert concurrent_load_seconds(link, 400.0, 1) == [pytest.approx(11.0)]
    assert concurrent_load_seconds(link, 400.0, 5) == [pytest.approx(5 * 440.0 / 100.0)] * 5


def test_the_cap_defaults_to_the_bandwidth_and_round_trips() -> None:
    plain = LinkSpec("n", 1e9, 1e-4)
    assert plain.flow_bandwidth_bytes_per_s == 1e9 and "flow_bandwidth_bytes_per_s" not in plain.to_dict()
    assert LinkSpec.from_dict(plain.to_dict()) == plain
    capped = LinkSpec.from_dict({"bandwidth_bytes_per_s": 8e9, "latency_s": 0.0,
                                 "flow_bandwidth_bytes_per_s": 4e9})
    assert capped.to_dict()["flow_bandwidth_bytes_per_s"] == 4e9
    assert LinkSpec.from_dict(capped.to_dict()) == capped
    assert capped.scaled(2).flow_bandwidth_bytes_per_s == 8e9  # each lane brings its own thread


@pytest.mark.parametrize("cap", [0.0, -1.0, 2e9, True, "1e9"])
def test_a_bad_cap_is_refused_by_name(cap: object) -> None:
    with pytest.raises(ValueError, match="flow_bandwidth_bytes_per_s"):
        LinkSpec("n", 1e9, 0.0, flow_bandwidth_bytes_per_s=cap)  # type: ignore[arg-type]
