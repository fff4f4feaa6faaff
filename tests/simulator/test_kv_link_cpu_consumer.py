"""The twin's CPU consumer rules: loads into never-written blocks pay a first-touch cost, and a
consumer's loads slow to a share of their speed while it runs a step; both off by default and
refused on a GPU profile."""

from __future__ import annotations

import pytest
import simpy

from twinserve.core.kv_connector import KVLoad, PeerConnectorMetadata
from twinserve.simulator import SimConfig, simulate
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.kv_transfer import LinkNetwork, LinkSpec, SimPeerWorker
from twinserve.traces import SyntheticConfig, synthetic_trace

# 100 bytes/s, no latency; a fresh byte costs 0.01 s more (one byte's worth at 100 B/s: doubles
# a cold load), a step leaves a load half its speed
CPU = LinkSpec("cpu", 100.0, 0.0, first_touch_s_per_byte=0.01, consumer_step_share=0.5)


def _pair(link: LinkSpec) -> tuple[simpy.Environment, SimPeerWorker, SimPeerWorker]:
    env = simpy.Environment()
    network = LinkNetwork(env, link)
    peers: dict[str, SimPeerWorker] = {}
    producer = SimPeerWorker("p", network, peers, 100.0, 1e6, lambda: None)
    consumer = SimPeerWorker("d", network, peers, 100.0, 1e6, lambda: None)
    return env, producer, consumer


def _load(env: simpy.Environment, producer: SimPeerWorker, consumer: SimPeerWorker, rid: str,
          blocks: list[int]) -> None:
    producer.start(PeerConnectorMetadata(sends={rid: blocks}))
    consumer.start(PeerConnectorMetadata(loads=[KVLoad(rid, "p", rid, blocks, blocks, "h", 0)]))


def _seconds(consumer: SimPeerWorker, rid: str) -> float:
    load = consumer.loads[rid]
    return load.end - load.start


def test_a_load_into_fresh_blocks_pays_the_first_touch_once() -> None:
    env, producer, consumer = _pair(CPU)
    _load(env, producer, consumer, "a", [0, 1])  # 200 bytes: 2 s, and 2 s of first touch
    env.run()
    _load(env, producer, consumer, "b", [1, 2])  # block 1 written before: one fresh block
    env.run()
    assert _seconds(consumer, "a") == pytest.approx(4.0)
    assert _seconds(consumer, "b") == pytest.approx(3.0)
    assert consumer.loads["a"].num_bytes == 200.0  # the work is not counted as bytes


def test_a_step_on_the_consumer_slows_its_loads_to_the_share() -> None:
    env, producer, consumer = _pair(CPU)
    consumer.touched.update({0})
    _load(env, producer, consumer, "a", [0])  # 1 s alone

    def step():
        consumer.step_started()  # from t=0 to t=1: half speed, 50 bytes moved
        yield env.timeout(1.0)
        consumer.step_ended()
    env.process(step())
    env.run()
    assert _seconds(consumer, "a") == pytest.approx(1.5)


def test_a_step_on_the_producer_or_a_default_link_changes_nothing() -> None:
    for link, side in ((CPU, "producer"), (LinkSpec("gpu", 100.0, 0.0), "consumer")):
        env, producer, consumer = _pair(link)
        consumer.touched.update({0})
        _load(env, producer, consumer, "a", [0])
        worker = producer if side == "producer" else consumer
        worker.step_started()
        env.run()
        worker.step_ended()
        assert _seconds(consumer, "a") == pytest.approx(1.0)


def test_the_rules_round_trip_and_are_validated() -> None:
    assert LinkSpec.from_dict(CPU.to_dict()) == CPU and CPU.cpu_consumer
    plain = LinkSpec("n", 1e9, 0.0)
    assert not plain.cpu_consumer
    assert {"first_touch_s_per_byte", "consumer_step_share"}.isdisjoint(plain.to_dict())
    assert CPU.scaled(2).consumer_step_share == 0.5
    for key, bad in (("first_touch_s_per_byte", -1e-9), ("consumer_step_share", 0.0),
                     ("consumer_step_share", 1.5), ("consumer_step_share", True)):
        with pytest.raises(ValueError, match=key):
            LinkSpec.from_dict({"bandwidth_bytes_per_s": 1e9, "latency_s": 0.0, key: bad})


def _pd_summary(hardware: str) -> dict:
    trace = synthetic_trace(SyntheticConfig(num_requests=8, request_rate=2.0, input_len=256,
                                            output_len=16, seed=2))
    cfg = SimConfig(model="smollm2-135m", hardware=hardware, prefill_instances=1,
                    decode_instances=1)
    return simulate(cfg, trace).summary


def _with_link(path, base: str, link: dict) -> str:
    hw = load_hardware(base)
    return str(type(hw).from_dict({**hw.to_dict(), "kv_link": link}).save(path))


def test_a_cpu_profile_prices_its_loads_with_the_rules(tmp_path) -> None:
    link = {"bandwidth_bytes_per_s": 4e9, "latency_s": 2e-4}
    plain = _pd_summary(_with_link(tmp_path / "plain.json", "cpu", link))
    ruled = _pd_summary(_with_link(tmp_path / "ruled.json", "cpu", {
        **link, "first_touch_s_per_byte": 1e-9, "consumer_step_share": 0.5}))
    assert ruled["kv_link_consumer_step_share"] == 0.5
    assert "kv_link_consumer_step_share" not in plain
    # 16 fresh blocks of SmolLM2 (5.9 MB): ~5.9 ms of first touch on top of ~1.7 ms, more
    # beside decode steps
    assert ruled["mean_kv_transfer_ms"] > plain["mean_kv_transfer_ms"] + 5.0


def test_a_gpu_profile_refuses_the_cpu_rules(tmp_path) -> None:
    path = _with_link(tmp_path / "gpu.json", "h100-sxm", {"bandwidth_bytes_per_s": 4e10, "latency_s": 1e-5,
                                             "consumer_step_share": 0.5})
    with pytest.raises(ValueError, match="consumer_step_share"):
        _pd_summary(path)


def test_a_step_begun_during_a_loads_latency_paces_it_once_it_flows() -> None:
    env, producer, consumer = _pair(LinkSpec("cpu", 100.0, 1.0, consumer_step_share=0.5))
    _load(env, producer, consumer, "a", [0])  # 1 s latency, then 100 bytes

    def step():
        consumer.step_started()  # 0 to 2 s: from 1 s at half speed (50 bytes), then alone
        yield env.timeout(2.0)
        consumer.step_ended()
    env.process(step())
    env.run()
    assert _seconds(consumer, "a") == pytest.approx(2.5)
