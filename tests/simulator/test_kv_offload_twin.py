"""The host KV tier's twin worker (simulator/kv_offload.py): copies charged over the host link."""

from __future__ import annotations

import json

import pytest

from twinserve.core.kv_offload import OffloadingConnectorMetadata
from twinserve.simulator import SimConfig, simulate
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.kv_offload import TwinOffloadingWorker, host_link_of
from twinserve.simulator.kv_transfer import LinkSpec
from twinserve.simulator.run import write_sim_run
from twinserve.simulator.twin_of_run import twin_config
from twinserve.traces import TraceRequest

MB = 1 << 20


def test_a_load_ends_after_latency_plus_bytes_over_bandwidth():
    worker = TwinOffloadingWorker(LinkSpec("pcie", 100 * MB, 0.001), MB)
    worker.start(OffloadingConnectorMetadata(loads={"a": [(0, 1), (1, 2)]}), now=1.0)
    assert worker.next_event_time() == pytest.approx(1.021)
    assert worker.get_finished(1.02).finished_recving == set()
    assert worker.get_finished(1.021).finished_recving == {"a"}
    assert worker.next_event_time() is None


def test_loads_queue_on_their_direction_stores_on_the_other():
    worker = TwinOffloadingWorker(LinkSpec("pcie", 100 * MB, 0.0), MB)
    meta = OffloadingConnectorMetadata(loads={"a": [(0, 0)] * 10, "b": [(1, 1)] * 10},
                                       stores=[(5, 5)] * 50)
    worker.start(meta, now=0.0)
    assert worker.get_finished(0.1).finished_recving == {"a"}  # b waits behind a
    assert worker.get_finished(0.2).finished_recving == {"b"}  # stores did not delay it
    assert worker.store_s == pytest.approx(0.5) and worker.load_s == pytest.approx(0.2)
    assert (worker.num_blocks_loaded, worker.num_blocks_stored) == (20, 50)


def test_a_cancelled_load_is_never_reported():
    worker = TwinOffloadingWorker(LinkSpec("pcie", 100 * MB, 0.0), MB)
    worker.start(OffloadingConnectorMetadata(loads={"a": [(0, 0)]}), now=0.0)
    worker.start(OffloadingConnectorMetadata(cancelled=["a"]), now=0.001)
    assert worker.get_finished(1.0).finished_recving == set()


def test_the_host_link_is_the_profiles_pcie():
    h100, cpu = host_link_of(load_hardware("h100-sxm")), host_link_of(load_hardware("cpu"))
    assert (h100.bandwidth_bytes_per_s, h100.latency_s) == (50e9, 20e-6)  # Gen5's preset latency
    assert (cpu.bandwidth_bytes_per_s, cpu.latency_s) == (10e9, 20e-6)
    with pytest.raises(ValueError, match="bytes_per_block"):
        TwinOffloadingWorker(h100, 0)


# ---- the twin with the host tier ----------------------------------------------------------------
def _trace() -> list[TraceRequest]:
    """A, B, C, then A again, one at a time: 100-token prompts of 6 shared 16-token blocks."""
    blocks = {"A": (1, 2, 3, 4, 5, 6), "B": (11, 12, 13, 14, 15, 16), "C": (21, 22, 23, 24, 25, 26)}
    return [TraceRequest(f"{i}-{name}", 100.0 * i, 100, 2, prefix_blocks=blocks[name])
            for i, name in enumerate("ABCA")]


def _twin(hardware: str = "h100-sxm", **kwargs):
    return simulate(SimConfig(model="smollm2-135m", hardware=hardware, block_size=16,
                              num_gpu_blocks_override=12, max_model_len=256, max_num_seqs=2,
                              **kwargs), _trace())


def test_the_flag_runs_the_tier_in_the_twin_and_reports_host_hits():
    plain, tier = _twin("cpu"), _twin("cpu", kv_offloading_size=0.05)
    assert "external_prefix_cache_hits" not in plain.summary
    s = tier.summary
    assert s["external_prefix_cache_hits"] == 96  # A's 6 blocks, evicted from the device by B, C
    assert s["external_prefix_cache_queries"] == 4 * 100
    assert s["kv_offload_blocks_loaded"] == 6 and s["kv_offload_blocks_stored"] == 18
    assert tier.engine_config.kv_transfer_config.kv_connector == "OffloadingConnector"
    # the reload saves the prefill of 96 tokens: the last request's TTFT falls
    assert tier.records[3].ttft < plain.records[3].ttft
    assert [r.ttft for r in tier.records[:3]] == pytest.approx([r.ttft for r in plain.records[:3]])


def test_the_reload_is_charged_over_the_profiles_pcie_link(tmp_path):
    profile = load_hardware("h100-sxm").to_dict()
    fast = _twin(kv_offloading_size=0.05)
    profile.update(name="h100-slow-pcie", pcie_bandwidth=1e6)  # 1 MB/s: seconds per block
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(profile))
    slow = _twin(str(path), kv_offloading_size=0.05)
    block_bytes = fast.engine_config.block_bytes
    extra = slow.records[3].ttft - fast.records[3].ttft
    assert extra == pytest.approx(6 * block_bytes / 1e6 - 6 * block_bytes / 50e9, rel=1e-3)


def test_host_hits_in_the_run_folders_summary_and_config(tmp_path):
    result = _twin("cpu", kv_offloading_size=0.05)
    out = write_sim_run(result, tmp_path / "run", {"trace": "ABCA"})
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert summary["external_prefix_cache_hits"] == 96
    assert config["kv_offloading_size"] == 0.05
    assert config["kv_offloading_blocks"] == int(0.05 * 2**30) // result.engine_config.block_bytes
    assert "kv_transfer_config" not in config  # a rerun from these keys sets it again
    again = twin_config(config, "smollm2-135m", "cpu")
    assert again.engine.kv_offloading_size == 0.05


def test_other_backends_and_two_connectors_are_refused_by_name():
    from twinserve.core.engine_args import EngineArgs
    with pytest.raises(ValueError, match="kv_offloading_backend 'lmcache' is not implemented"):
        EngineArgs(kv_offloading_size=1.0, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="one connector per engine"):
        EngineArgs(kv_offloading_size=1.0, kv_transfer_config={"kv_connector": "PeerConnector"})
    pd = SimConfig(model="llama-3-8b", kv_offloading_size=4.0, prefill_instances=1,
                   decode_instances=1)
    with pytest.raises(ValueError, match="kv_offloading_size is not supported with a disagg"):
        simulate(pd, _trace())
    with pytest.raises(ValueError, match="kv_offloading_size with a sliding window"):
        simulate(SimConfig(model="mistral-7b-v0.1", hardware="h100-sxm", kv_offloading_size=1.0),
                 _trace())
