"""The twin's KV link: the flow model's times, max-min fair sharing, presets and profiles."""

from __future__ import annotations

import pytest
import simpy

from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.kv_transfer import Flow, LinkNetwork, LinkSpec, link_presets, max_min_rates

LINK = LinkSpec("test", 100.0, 0.5)  # 100 bytes/s, half a second of latency


def _run(transfers: list[tuple[float, str, str, float]], link: LinkSpec = LINK) -> list[float]:
    """Completion times of flows (start time, src, dst, bytes)."""
    env = simpy.Environment()
    net = LinkNetwork(env, link)
    ends = [float("nan")] * len(transfers)

    def go(k, start, src, dst, size):
        yield env.timeout(start)
        flow = net.transfer(src, dst, size)
        yield flow.done
        ends[k] = env.now

    for k, t in enumerate(transfers):
        env.process(go(k, *t))
    env.run()
    return ends


def test_one_flow_takes_latency_plus_bytes_over_bandwidth():
    assert _run([(0.0, "p0", "d0", 1000.0)]) == [pytest.approx(0.5 + 10.0)]


def test_two_flows_from_one_sender_each_take_twice_as_long():
    ends = _run([(0.0, "p0", "d0", 1000.0), (0.0, "p0", "d1", 1000.0)])
    assert ends == [pytest.approx(0.5 + 20.0)] * 2


def test_two_flows_into_one_receiver_share_its_ingress():
    ends = _run([(0.0, "p0", "d0", 1000.0), (0.0, "p1", "d0", 1000.0)])
    assert ends == [pytest.approx(20.5)] * 2


def test_flows_on_disjoint_links_do_not_contend():
    ends = _run([(0.0, "p0", "d0", 1000.0), (0.0, "p1", "d1", 1000.0)])
    assert ends == [pytest.approx(10.5)] * 2


def test_a_flow_that_ends_early_gives_its_share_back():
    # 500 and 1500 bytes from one sender: both at 50 B/s until the small one ends at 10 s of
    # flow; the big one has 1000 left, then runs alone at 100 B/s: 10 s more
    ends = _run([(0.0, "p0", "d0", 500.0), (0.0, "p0", "d1", 1500.0)])
    assert ends == [pytest.approx(10.5), pytest.approx(20.5)]


def test_a_late_flow_slows_the_running_one_from_its_arrival_on():
    # flow A alone for 5 s (500 B), then shares with B: A's last 500 B at 50 B/s = 10 s
    ends = _run([(0.0, "p0", "d0", 1000.0), (5.0, "p0", "d1", 500.0)], LinkSpec("l", 100.0, 0.0))
    assert ends == [pytest.approx(15.0), pytest.approx(15.0)]


def test_max_min_fairness_gives_the_unconstrained_flow_the_leftover():
    # p0 sends to d0 and d1; p1 also sends to d1. d1's ingress is shared by two flows (50 each),
    # p0's egress by two: its flow to d0 gets what p0 has left after d1's share (50)
    env = simpy.Environment()
    flows = [Flow("p0", "d0", 1.0, env.event()), Flow("p0", "d1", 1.0, env.event()),
             Flow("p1", "d1", 1.0, env.event()), Flow("p2", "d2", 1.0, env.event())]
    max_min_rates(flows, 100.0)
    assert [f.rate for f in flows] == [50.0, 50.0, 50.0, 100.0]
    flows = [Flow("p0", "d0", 1.0, env.event()), Flow("p1", "d0", 1.0, env.event()),
             Flow("p1", "d1", 1.0, env.event()), Flow("p1", "d2", 1.0, env.event())]
    max_min_rates(flows, 90.0)  # p1's egress: three flows at 30; d0 gives p0 the other 60
    assert [f.rate for f in flows] == [60.0, 30.0, 30.0, 30.0]


def test_a_cancelled_flow_never_completes_and_frees_its_share():
    env = simpy.Environment()
    net = LinkNetwork(env, LinkSpec("l", 100.0, 0.0))
    a, b = net.transfer("p0", "d0", 1000.0), net.transfer("p0", "d1", 1000.0)
    ends = {}

    def watch(name, flow):
        yield flow.done
        ends[name] = env.now

    def cancel_a():
        yield env.timeout(2.0)  # both at 50 B/s: b has 900 left, then alone at 100 B/s
        net.cancel(a)

    for name, flow in (("a", a), ("b", b)):
        env.process(watch(name, flow))
    env.process(cancel_a())
    env.run()
    assert ends == {"b": pytest.approx(11.0)}


def test_link_presets_follow_the_gpu_generation():
    hopper, ampere = link_presets("H100-SXM"), link_presets("A100-80GB")
    assert hopper["nvlink"].bandwidth_bytes_per_s == 450e9
    assert ampere["nvlink"].bandwidth_bytes_per_s == 300e9
    assert (hopper["infiniband"].bandwidth_bytes_per_s, ampere["infiniband"].bandwidth_bytes_per_s) \
        == (50e9, 25e9)
    assert (hopper["pcie"].bandwidth_bytes_per_s, ampere["pcie"].bandwidth_bytes_per_s) == (50e9, 25e9)
    assert link_presets("cpu") == {}
    assert link_presets("NVIDIA H100 80GB HBM3") == hopper  # a calibrated profile's device name


def test_a_profile_resolves_presets_and_a_measured_link():
    h100 = load_hardware("h100-sxm")
    assert h100.kv_link_spec().name == "nvlink"
    assert h100.kv_link_spec("infiniband").bandwidth_bytes_per_s == 50e9
    with pytest.raises(ValueError, match="kv_link 'measured' is not known.*valid: nvlink"):
        h100.kv_link_spec("measured")
    data = h100.to_dict()
    assert "kv_link" not in data  # an uncalibrated profile's file stays as it was
    measured = type(h100).from_dict({**data, "kv_link": {"bandwidth_bytes_per_s": 2e9,
                                                         "latency_s": 1e-4}})
    assert measured.kv_link_spec() == LinkSpec("measured", 2e9, 1e-4)
    assert measured.to_dict()["kv_link"] == {"bandwidth_bytes_per_s": 2e9, "latency_s": 1e-4}
    cpu = type(h100).from_dict({**load_hardware("cpu").to_dict(),
                                "kv_link": {"bandwidth_bytes_per_s": 5e9, "latency_s": 2e-4}})
    assert cpu.kv_link_spec().bandwidth_bytes_per_s == 5e9
    with pytest.raises(ValueError, match="kv_link.latency_s is required"):
        type(h100).from_dict({**data, "kv_link": {"bandwidth_bytes_per_s": 1e9}})


def test_link_spec_refuses_bad_numbers_by_name():
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        LinkSpec("x", 0.0, 0.0)
    with pytest.raises(ValueError, match="latency_s"):
        LinkSpec("x", 1.0, -1.0)
    with pytest.raises(ValueError, match="unknown key.*bw"):
        LinkSpec.from_dict({"bw": 1.0, "latency_s": 0.0, "bandwidth_bytes_per_s": 1.0})
