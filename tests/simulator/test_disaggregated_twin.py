"""The twin's xPyD fleet: requests conserved, TTFT parts that add up, no block left behind on
either pool, the link's effect, and an aggregated run (X = Y = 0) unchanged."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from twinserve.core.run_dir import PD_REQUEST_COLUMNS
from twinserve.entrypoints.cli.main import main
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.simulator.disaggregated import replay_fleet
from twinserve.simulator.run import _engine_requests, build_engine_config
from twinserve.traces import SyntheticConfig, synthetic_trace

SMALL = {"model": "llama-3-8b", "hardware": "h100-sxm", "max_num_seqs": 16,
         "max_num_batched_tokens": 2048}
WL = SyntheticConfig(num_requests=60, request_rate=20.0, input_len=600, output_len=30,
                     range_ratio=0.5, prefix_len=128, prefix_share=0.5, seed=3)


def _rows(folder: Path) -> list[dict[str, str]]:
    with open(folder / "requests.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def pd_run(tmp_path_factory):
    trace = synthetic_trace(WL)
    cfg = SimConfig(**SMALL, prefill_instances=2, decode_instances=1)
    result = simulate(cfg, trace)
    folder = write_sim_run(result, tmp_path_factory.mktemp("pd") / "run", {"trace": "synthetic"})
    return trace, result, folder


def test_every_request_runs_prefill_then_decode_to_its_trace_length(pd_run):
    trace, result, _ = pd_run
    by_id = {r.request_id: r for r in result.records}
    assert set(by_id) == {tr.request_id for tr in trace}
    for tr in trace:
        rec = by_id[tr.request_id]
        assert rec.success and rec.output_tokens == tr.output_tokens
        assert rec.input_tokens == tr.input_tokens
    s = result.summary
    assert s["completed"] == len(trace) and s["num_kv_transfers"] == len(trace)
    assert s["prefill_instances"] == 2 and s["decode_instances"] == 1
    assert 0 < s["prefill_utilization"] < 1 and 0 < s["decode_utilization"] <= 1


def test_the_ttft_parts_add_up_to_the_ttft_in_the_run_folder(pd_run):
    trace, result, folder = pd_run
    rows = _rows(folder)
    assert list(rows[0])[-len(PD_REQUEST_COLUMNS):] == list(PD_REQUEST_COLUMNS)
    block_bytes = result.engine_config.block_bytes
    engines = set()
    for row in rows:
        parts = [float(row[f"ttft_{p}_s"]) for p in ("queue", "prefill", "transfer", "decode")]
        assert all(p >= 0 for p in parts)
        # (each part written to 9 decimals of a second: 4 roundings of 0.5 ns at most)
        assert sum(parts) * 1e3 == pytest.approx(float(row["ttft_ms"]), abs=2.5e-6)
        assert float(row["kv_transfer_s"]) > 0
        assert float(row["ttft_transfer_s"]) >= float(row["kv_transfer_s"]) - 1e-12
        assert int(row["kv_transfer_bytes"]) % block_bytes == 0
        # the whole prompt's blocks move (no prefix hits on the single decode instance's cache
        # can cover a prompt's own tokens)
        assert int(row["kv_transfer_bytes"]) >= block_bytes
        engines.add((row["prefill_engine"], row["decode_engine"]))
    assert {p for p, _ in engines} == {"prefill-0", "prefill-1"}
    assert {d for _, d in engines} == {"decode-0"}
    assert result.summary["mean_ttft_transfer_ms"] > 0


def test_no_block_is_left_on_either_pool_after_the_run():
    trace = synthetic_trace(WL)
    cfg = SimConfig(**SMALL, prefill_instances=1, decode_instances=2, kv_link="infiniband")
    build = build_engine_config(cfg)
    requests = _engine_requests(trace, build.model.vocab_size, cfg.engine.block_size)
    fleet, _, link = replay_fleet(cfg, requests)
    assert link.name == "infiniband"
    assert len(fleet.recorder.requests) == len(trace)
    for inst in fleet.prefill + fleet.decode:
        sched = inst.scheduler
        sched.kv.check_consistency()
        assert not sched.kv.tables and not sched.sending and not sched.waiting_for_remote
        assert sched.kv.num_free_blocks == sched.config.num_gpu_blocks
        assert not inst.worker.published and not inst.worker.flows
    assert not fleet.producers and not fleet.originals


def test_a_slower_link_lengthens_transfers_and_ttft():
    trace = synthetic_trace(WL)
    results = {link: simulate(SimConfig(**SMALL, prefill_instances=1, decode_instances=1,
                                        kv_link=link), trace).summary
               for link in ("nvlink", "pcie")}
    nv, pcie = results["nvlink"], results["pcie"]
    # same bytes, 9x less bandwidth: each transfer takes longer, and so does TTFT
    assert nv["kv_transfer_bytes"] == pcie["kv_transfer_bytes"] > 0
    assert pcie["mean_kv_transfer_ms"] > 5 * nv["mean_kv_transfer_ms"]
    assert pcie["mean_ttft_ms"] > nv["mean_ttft_ms"]


def test_the_aggregated_equivalent_writes_todays_files(tmp_path):
    trace = synthetic_trace(WL)
    plain = write_sim_run(simulate(SimConfig(**SMALL), trace), tmp_path / "plain", {"t": 1})
    zero = write_sim_run(simulate(SimConfig(**SMALL, prefill_instances=0, decode_instances=0),
                                  trace), tmp_path / "zero", {"t": 1})
    files = sorted(p.name for p in plain.iterdir())
    assert files == sorted(p.name for p in zero.iterdir())
    for name in files:
        assert (plain / name).read_bytes() == (zero / name).read_bytes(), name
    config = (plain / "config.json").read_text()
    assert "prefill_instances" not in config and "kv_transfer_config" not in config
    assert "prefill_engine" not in (plain / "requests.csv").read_text().splitlines()[0]


def test_a_disaggregated_config_records_its_keys(pd_run):
    _, _, folder = pd_run
    config = (folder / "config.json").read_text()
    assert '"prefill_instances": 2' in config and '"decode_instances": 1' in config


@pytest.mark.parametrize("kwargs, match", [
    ({"prefill_instances": 1}, "go together"),
    ({"prefill_instances": -1, "decode_instances": 1}, "prefill_instances must be"),
    ({"prefill_instances": 1, "decode_instances": 1, "num_replicas": 2}, "num_replicas"),
    ({"kv_link": "nvlink"}, "not disaggregated"),
])
def test_sim_config_refuses_inconsistent_pools(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SimConfig(**SMALL, **kwargs)


def test_an_unknown_link_is_refused_by_name():
    cfg = SimConfig(**SMALL, prefill_instances=1, decode_instances=1, kv_link="ethernet")
    with pytest.raises(ValueError, match="kv_link 'ethernet'.*valid: nvlink, infiniband, pcie"):
        simulate(cfg, synthetic_trace(WL))


def test_the_simulate_command_takes_the_pool_flags(tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(["simulate", "--trace", "synthetic", "--num-requests", "20", "--input-len", "300",
                 "--output-len", "10", "--request-rate", "10", "--model", "llama-3-8b",
                 "--hardware", "h100-sxm", "--prefill-instances", "1", "--decode-instances", "1",
                 "--kv-link", "pcie", "--out", str(out), "--disable-tqdm"])
    assert code == 0
    rows = _rows(out)
    assert len(rows) == 20 and all(r["decode_engine"] == "decode-0" for r in rows)
    assert not any(math.isnan(float(r["kv_transfer_s"])) for r in rows)
    assert '"kv_link": "pcie"' in (out / "config.json").read_text()


def test_the_pool_keys_survive_replace_and_a_config_file(tmp_path):
    cfg = SimConfig(**SMALL, prefill_instances=1, decode_instances=1, kv_link="pcie")
    wider = cfg.replace(decode_instances=3)
    assert (wider.prefill_instances, wider.decode_instances, wider.kv_link) == (1, 3, "pcie")
    assert "prefill_instances" not in SimConfig(**SMALL).flat()
    config = tmp_path / "pd.yaml"
    config.write_text("prefill_instances: 2\ndecode_instances: 1\nkv_link: infiniband\n"
                      "max_num_seqs: 8\n")
    out = tmp_path / "run"
    assert main(["simulate", "--config", str(config), "--trace", "synthetic", "--num-requests",
                 "10", "--input-len", "200", "--output-len", "5", "--model", "llama-3-8b",
                 "--hardware", "a100-80gb", "--out", str(out), "--disable-tqdm"]) == 0
    text = (out / "config.json").read_text()
    assert '"kv_link": "infiniband"' in text and '"prefill_instances": 2' in text
    assert {r["prefill_engine"] for r in _rows(out)} <= {"prefill-0", "prefill-1"}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_loads_that_time_out_follow_the_failure_policy_and_leak_nothing(policy):
    trace = synthetic_trace(WL)
    kv = {"kv_load_failure_policy": policy,
          "kv_connector_extra_config": {"transfer_timeout_s": 0.001}}  # below any transfer's time
    cfg = SimConfig(**SMALL, prefill_instances=1, decode_instances=1, kv_link="pcie",
                    kv_transfer_config=kv)
    build = build_engine_config(cfg)
    requests = _engine_requests(trace, build.model.vocab_size, cfg.engine.block_size)
    fleet, _, _ = replay_fleet(cfg, requests)
    records = {r.request_id: r for r in fleet.recorder.requests}
    assert set(records) == {tr.request_id for tr in trace}
    if policy == "recompute":  # every prompt computed again on the decode instance
        assert all(r.success and r.output_tokens == tr.output_tokens
                   for tr, r in ((tr, records[tr.request_id]) for tr in trace))
    else:
        assert all(not r.success and r.finish_reason == "error" for r in records.values())
    # no load finished: each timed out (or found its producer's send expired)
    assert all(math.isnan(load.end) for load in fleet.decode[0].worker.loads.values())
    for inst in fleet.prefill + fleet.decode:
        sched = inst.scheduler
        sched.kv.check_consistency()
        assert not sched.kv.tables and not sched.sending and not sched.waiting_for_remote
