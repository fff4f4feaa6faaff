"""``plan --verify-top``: the verdict on constructed tables, the twin read the same way at both
rates, the flow with a stand-in for the real engine, and one real replay end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from twinserve.entrypoints.cli import plan_verify
from twinserve.entrypoints.cli.main import main
from twinserve.planner.output import _sim_of
from twinserve.planner.plan import run_plan
from twinserve.planner.search import RateGrid
from twinserve.planner.slo import FAIL, PASS
from twinserve.planner.spec import parse_plan
from twinserve.planner.verify import OPTIMISTIC, PESSIMISTIC, TIGHT, TwinSide, VerifyRates, capacity_verdict

TINY_CPU = {"model": "smollm2-135m", "hardware": ["cpu"], "max_gpus": 1, "prices": {"cpu": 0.05},
            "slo": {"ttft_p90_ms": 5000, "tpot_p99_ms": 2000},
            "space": {"max_num_seqs": [8], "max_num_batched_tokens": [256]},
            "search": {"tolerance": 0.5, "base_rps": 0.5, "min_rps": 0.25, "max_rps": 8}}


# a small search whose SLOs any replay meets, verified for its best configuration
TINY_SEARCH = ["--max-num-seqs", "8", "--max-num-batched-tokens", "256",
               "--slo", "ttft_p90_ms=30000", "--slo", "tpot_p99_ms=10000", "--duration", "2",
               "--base-rps", "0.5", "--tolerance", "0.5", "--min-rps", "0.25", "--max-rps", "1",
               "--workers", "1", "--verify-top", "1"]


def _tiny_trace(path: Path, n: int = 12) -> str:
    rows = "".join(f"{i * 0.5},{32 + 4 * i},4\n" for i in range(n))
    path.write_text("arrival_time_s,input_tokens,output_tokens\n" + rows)
    return str(path)


def test_the_verdict_of_constructed_tables() -> None:
    table = pd.DataFrame({"measured_verdict": [PASS, PASS, FAIL, FAIL],
                          "measured_verdict_above": [FAIL, PASS, None, PASS]})
    verdicts = [capacity_verdict(r.measured_verdict, r.measured_verdict_above)
                for r in table.itertuples()]
    assert verdicts == [TIGHT, PESSIMISTIC, OPTIMISTIC, OPTIMISTIC]
    with pytest.raises(ValueError, match="above"):
        capacity_verdict(PASS, None)  # a pass at capacity needs the replay above
    with pytest.raises(ValueError, match="at_capacity"):
        capacity_verdict("maybe", FAIL)


def test_the_rate_above_is_the_search_s_next_bracket() -> None:
    grid = RateGrid(base_rps=0.5, tolerance=0.5, min_rps=0.25, max_rps=8)
    rates = VerifyRates.of(grid.rate(2), grid)
    assert (rates.capacity_index, rates.above_rps) == (2, pytest.approx(grid.rate(2) * 1.5))
    assert VerifyRates.of(grid.rate(grid.highest), grid).above_rps > grid.max_rps  # beyond the grid
    with pytest.raises(ValueError, match="capacity_rps"):
        VerifyRates.of(grid.rate(2) * 1.1, grid)


def test_the_twin_is_read_from_full_replays_at_both_rates(tmp_path) -> None:
    spec = parse_plan({"model": "llama-3-8b", "hardware": ["h100-sxm"], "max_gpus": 1,
                       "workload": {"trace": "azure-conv", "num_requests": 300, "duration_s": 6},
                       "slo": {"ttft_p90_ms": 1000, "tpot_p99_ms": 60},
                       "space": {"max_num_seqs": [64], "max_num_batched_tokens": [2048]},
                       "search": {"tolerance": 0.4, "max_rps": 40}})
    result = run_plan(spec, tmp_path)
    row = result.best
    twin = TwinSide(spec, tmp_path)
    rates = VerifyRates.of(row["capacity_rps"], twin.grid)
    sim = _sim_of(row, spec)
    folder = tmp_path / row["folder"]
    # a point the search ran to its end is read back as it is (marked here to tell it apart)
    at_file = folder / f"r{rates.capacity_index}.json"
    at_point = {**json.loads(at_file.read_text()), "wall_time_s": -1.0}
    at_file.write_text(json.dumps(at_point))
    assert twin.point(row, sim, rates.capacity_index) == at_point and at_point["verdict"] == PASS
    # one the search stopped early counts only the requests it saw: replayed to its end now
    above_file = folder / f"r{rates.capacity_index + 1}.json"
    searched = json.loads(above_file.read_text())
    assert searched["verdict"] == FAIL
    cut = {**searched, "stopped_early": True, "attainment": {k: 0.0 for k in searched["attainment"]}}
    above_file.write_text(json.dumps(cut))
    above = twin.point(row, sim, rates.capacity_index + 1)
    assert above["verdict"] == FAIL and not above["stopped_early"]
    assert above["finished"] == above["num_requests"]
    assert above["attainment"] == pytest.approx(searched["attainment"]) if not searched["stopped_early"] \
        else all(above["attainment"][k] >= v for k, v in searched["attainment"].items())
    assert max(above["attainment"].values()) > 0


def _stand_in(passes_up_to: float, calls: list[float]):
    """A real engine that meets the SLOs up to ``passes_up_to`` req/s (a requests.csv)."""
    def make(config, model, trace_name, hardware):
        def run(requests, folder: Path) -> Path:
            rate = (len(requests) - 1) / (requests[-1].arrival_time - requests[0].arrival_time)
            calls.append(rate)
            ok = rate <= passes_up_to * (1 + 1e-9)
            folder.mkdir(parents=True)
            ms = 10.0 if ok else 1e7
            pd.DataFrame({"success": [True] * len(requests), "ttft_ms": ms, "tpot_ms": ms,
                          "e2el_ms": ms}).to_csv(folder / "requests.csv", index=False)
            return folder
        return run
    return make


@pytest.mark.parametrize(("real_over_twin", "verdict", "replays"), [
    (1.0, TIGHT, 2), (10.0, PESSIMISTIC, 2), (0.5, OPTIMISTIC, 1)])
def test_verify_replays_at_capacity_and_above(tmp_path, monkeypatch, capsys, real_over_twin,
                                              verdict, replays) -> None:
    trace = _tiny_trace(tmp_path / "tiny.csv")
    spec = parse_plan({**TINY_CPU, "workload": {"trace": trace, "duration_s": 2}})
    result = run_plan(spec, tmp_path / "out")
    capacity = result.best["capacity_rps"]
    calls: list[float] = []
    # a real engine whose capacity is the twin's times real_over_twin
    monkeypatch.setattr(plan_verify, "_real_replay", _stand_in(capacity * real_over_twin, calls))
    [entry] = plan_verify.verify_top(result, spec, tmp_path / "out", 1)
    printed = capsys.readouterr().out
    assert entry["capacity_verdict"] == verdict and f": {verdict} (" in printed
    assert len(calls) == replays
    assert entry["rate_above_rps"] == pytest.approx(capacity * 1.5)
    frame = pd.read_csv(tmp_path / "out" / "verify.csv")
    assert frame.loc[0, "capacity_verdict"] == verdict
    assert {"predicted_attainment_ttft_p90_ms", "predicted_attainment_above_ttft_p90_ms",
            "measured_attainment_tpot_p99_ms", "predicted_verdict_above"} <= set(frame.columns)
    if replays == 2:
        assert frame.loc[0, "measured_attainment_above_ttft_p90_ms"] == \
            (1.0 if verdict == PESSIMISTIC else 0.0)
        assert "one step above" in printed
    else:
        assert "measured_verdict_above" not in frame.columns
        assert "not replayed above" in printed
        assert not math.isnan(frame.loc[0, "predicted_attainment_above_ttft_p90_ms"])


def test_what_a_pd_deployment_needs_here() -> None:
    import torch

    from twinserve.gpu.worker.cpu_cores import usable_cores
    if torch.cuda.is_available():
        pytest.skip("the CPU cases assume a machine without CUDA")
    pd_row = {"hardware": "cpu", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
              "prefill_instances": 1, "decode_instances": 1, "gpus": 2}
    if usable_cores() >= 2:
        assert plan_verify.verifiable(pd_row, "smollm2-135m") == ""
    many = {**pd_row, "prefill_instances": usable_cores(), "gpus": usable_cores() + 1}
    assert f"runs {usable_cores() + 1} instances, each on at least one core" in \
        plan_verify.verifiable(many, "smollm2-135m")
    assert "TP/PP > 1" in plan_verify.verifiable({**pd_row, "tensor_parallel_size": 2}, "smollm2-135m")
    assert "checkpoint" in plan_verify.verifiable(pd_row, "llama-3-8b")


def test_what_replicas_need_here() -> None:
    import torch

    from twinserve.gpu.worker.cpu_cores import usable_cores
    if torch.cuda.is_available():
        pytest.skip("the CPU cases assume a machine without CUDA")
    row = {"hardware": "cpu", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
           "num_replicas": 2, "router": "cache-aware", "gpus": 2}
    if usable_cores() >= 2:
        assert plan_verify.verifiable(row, "smollm2-135m") == ""
    n = usable_cores() + 1
    assert f"{n} replicas run {n} worker ranks, each on a core" in plan_verify.verifiable(
        {**row, "num_replicas": n, "gpus": n}, "smollm2-135m")


@pytest.mark.slow
def test_verify_top_replays_replicas_through_the_data_parallel_front(tmp_path, capsys) -> None:
    from twinserve.gpu.worker.cpu_cores import usable_cores
    if usable_cores() < 2:
        pytest.skip("2 replicas run on a core each at least")
    out = tmp_path / "out"
    code = main(["plan", "--trace", _tiny_trace(tmp_path / "tiny.csv"), "--model",
                 "smollm2-135m", "--hardware", "cpu", "--price", "cpu=0.05", "--max-gpus", "2",
                 "--tp", "1", "--pp", "1", "--replicas", "2", "--routers", "cache-aware",
                 *TINY_SEARCH, "--out", str(out)])
    assert code == 0
    row = pd.read_csv(out / "verify.csv").iloc[0]
    assert row["verifiable"] and "x2 cache-aware" in row["name"], row.to_dict()
    for suffix in ("", "_above"):
        run = Path(row[f"folder{suffix}"])
        config = json.loads((run / "config.json").read_text())
        assert (config["data_parallel_size"], config["router"]) == (2, "cache-aware")
        requests = pd.read_csv(run / "requests.csv")
        assert set(requests["replica"]) <= {0, 1}  # through the data-parallel front
        assert row[f"measured_verdict{suffix}"] in (PASS, FAIL)
    assert row["capacity_verdict"] in (TIGHT, PESSIMISTIC)
    assert "one step above" in capsys.readouterr().out


@pytest.mark.slow
def test_verify_top_replays_both_rates_for_real(tmp_path, capsys) -> None:
    trace = _tiny_trace(tmp_path / "tiny.csv")
    out = tmp_path / "out"
    code = main(["plan", "--trace", trace, "--model", "smollm2-135m", "--hardware", "cpu",
                 "--price", "cpu=0.05", "--max-gpus", "1", *TINY_SEARCH, "--out", str(out)])
    assert code == 0
    frame = pd.read_csv(out / "verify.csv")
    row = frame.iloc[0]
    assert row["verifiable"] and row["rate_above_rps"] == pytest.approx(row["capacity_rps"] * 1.5)
    assert row["capacity_verdict"] in (TIGHT, PESSIMISTIC, OPTIMISTIC)
    # 4 output tokens of short prompts at most 1.1 req/s, against limits of seconds even on a
    # loaded host (the p90 of 3-4 requests is the slowest one): it passes at capacity, so both
    # rates replay
    assert row["measured_verdict"] == PASS, row.to_dict()
    for suffix in ("", "_above"):
        assert row[f"measured_verdict{suffix}"] in (PASS, FAIL)
        assert 0 <= row[f"measured_attainment{suffix}_ttft_p90_ms"] <= 1
        assert (Path(row[f"folder{suffix}"]) / "requests.csv").is_file()
    assert "one step above" in capsys.readouterr().out


def _cpu_profile_with_link(path: Path) -> str:
    """The bundled CPU profile with a KV link (the twin's xPyD fleet needs one), named cpu-pd."""
    from twinserve.simulator import hardware
    data = json.loads((Path(hardware.__file__).parent / "data" / "hardware" / "cpu.json").read_text())
    data.update(name="cpu-pd", kv_link={"bandwidth_bytes_per_s": 5e9, "latency_s": 1e-4})
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.slow
def test_verify_top_replays_a_pd_deployment_through_validate_s_front(tmp_path, capsys) -> None:
    from twinserve.gpu.worker.cpu_cores import usable_cores
    if usable_cores() < 2:
        pytest.skip("1P1D runs two instances, one core each at least")
    out, spec = tmp_path / "out", tmp_path / "plan.yaml"
    # the instances' side channels on ports of this test's own (kv_port, kv_port + 1)
    spec.write_text("engine:\n  kv_transfer_config: {kv_connector: PeerConnector, kv_port: 15630}\n")
    code = main(["plan", "--spec", str(spec), "--trace", _tiny_trace(tmp_path / "tiny.csv"),
                 "--model", "smollm2-135m",
                 "--hardware", _cpu_profile_with_link(tmp_path / "cpu-pd.json"),
                 "--price", "cpu-pd=0.05", "--max-gpus", "2", "--disaggregation", "1P1D",
                 *TINY_SEARCH, "--out", str(out)])
    assert code == 0
    row = pd.read_csv(out / "verify.csv").iloc[0]
    assert row["verifiable"] and "1P1D" in row["name"]
    for suffix in ("", "_above"):
        run = Path(row[f"folder{suffix}"])
        config = json.loads((run / "config.json").read_text())
        assert (config["prefill_instances"], config["decode_instances"]) == (1, 1)
        assert config["kv_transfer_config"]["kv_port"] == 15630  # the plan's fixed arguments
        requests = pd.read_csv(run / "requests.csv")
        assert set(requests["prefill_engine"]) == {"prefill-0"}  # through the P/D front
        assert row[f"measured_verdict{suffix}"] in (PASS, FAIL)
    assert row["capacity_verdict"] in (TIGHT, PESSIMISTIC)
    assert "one step above" in capsys.readouterr().out
