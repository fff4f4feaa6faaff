"""Measuring the twin against the real engine: ``validate``'s error table, the replays'
reproducibility, and the fidelity study's workloads, table and round order (no model runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_error_rows_compare_with_the_median_of_the_real_runs() -> None:
    from twinserve.reports.fidelity import error_rows, format_errors, spread_pct
    reals = [{"mean_ttft_ms": v, "request_throughput": 2.0} for v in (100.0, 300.0, 120.0)]
    rows = {r["metric"]: r for r in error_rows(reals, {"mean_ttft_ms": 132.0,
                                                         "request_throughput": 2.2})}
    ttft = rows["mean_ttft_ms"]
    assert ttft["real"] == 120.0 and ttft["real_min"] == 100.0 and ttft["real_max"] == 300.0
    assert ttft["rel_error_pct"] == pytest.approx(10.0) and ttft["within_target"] == "true"
    assert rows["request_throughput"]["within_target"] == "false"  # +10% against a 5% target
    assert rows["mean_tpot_ms"]["real_runs"] == 0 and rows["mean_tpot_ms"]["within_target"] == ""
    with pytest.raises(ValueError, match="at least one real run"):
        error_rows([], {})
    # validate's table names the targets the runs' own spread is too wide to resolve: TTFT's
    # 100..300 ms around 120 (83%) against 10%; throughput's runs agree, no spread
    assert spread_pct(ttft) == pytest.approx(100 * 200 / 2 / 120)
    table = format_errors(list(rows.values()))
    # TTFT's +10% is within its target; throughput's +10% misses (its runs agree): the table
    # marks a miss inside the runs' wider spread with ``~``, as the fidelity study does
    assert " ok " in next(line for line in table.splitlines() if "mean_ttft_ms" in line)
    assert "MISS" in next(line for line in table.splitlines() if "request_throughput" in line)
    wide = error_rows(reals, {"mean_ttft_ms": 150.0})
    assert " ~ " in next(line for line in format_errors(wide).splitlines() if "mean_ttft_ms" in line)
    assert table.endswith("host: 1/2 targeted metrics' replays spread wider than their target "
                          "(median 83.3%): there the host, not the twin, sets the verdict; "
                          "rerun on a quieter host")
    assert "host:" not in format_errors(error_rows(reals[:1], {"mean_ttft_ms": 132.0}))


def test_fidelity_reproducibility_rows_measure_replays_against_each_other(tmp_path: Path) -> None:
    """The real-run row: each replay against the median of the others, the median error size."""
    from twinserve.benchmarks.fidelity import reproducibility_rows
    runs = []
    for i, ttft in enumerate((100.0, 110.0, 150.0)):
        runs.append(tmp_path / f"run-{i}")
        runs[-1].mkdir()
        (runs[-1] / "summary.json").write_text(json.dumps(
            {"request_throughput": 2.0, "mean_ttft_ms": ttft, "mean_tpot_ms": None,
             "num_preemptions": 0}))
    rows = {r["metric"]: r for r in reproducibility_rows("fcfs", runs)}
    # 100 vs 130: 23.1%; 110 vs 125: 12.0%; 150 vs 105: 42.9% -> median 23.1%
    assert rows["mean_ttft_ms"]["rel_error_pct"] == pytest.approx(100 * 30 / 130)
    assert rows["mean_ttft_ms"]["within_target"] == "false"
    assert rows["mean_ttft_ms"]["real"] == 110.0 and rows["mean_ttft_ms"]["profile"] == "real-run"
    assert rows["request_throughput"]["rel_error_pct"] == 0.0
    assert rows["request_throughput"]["within_target"] == "true"
    assert rows["mean_tpot_ms"]["real_runs"] == 0 and rows["mean_tpot_ms"]["within_target"] == ""
    assert rows["num_preemptions"]["rel_error_pct"] == 0.0  # all zero: no spread
    assert reproducibility_rows("fcfs", runs[:2]) == []


def test_fidelity_study_workloads_are_valid_and_differ(tmp_path: Path, monkeypatch) -> None:
    """Every workload of the study loads at the study's engine limits and selects requests that
    fit the model length; the table marks targets, spreads and misses."""
    import functools

    from twinserve.traces import cli_args
    monkeypatch.setattr(cli_args, "load_trace", functools.cache(cli_args.load_trace))
    from twinserve.benchmarks.fidelity_study import (
        ENGINE,
        WORKLOADS,
        format_table,
        study_rows,
    )
    from twinserve.reports.fidelity import host_check, verdict
    policies, traces = set(), set()
    for w in WORKLOADS:
        trace = w.trace.load().requests
        engine = w.engine_args(ENGINE)
        assert 10 <= len(trace) <= 40, w.name
        assert engine.max_num_seqs == 32 and engine.max_num_batched_tokens == 512, w.name
        assert all(r.input_tokens + r.output_tokens <= engine.max_model_len <= 512
                   for r in trace), w.name
        policies.add(engine.scheduling_policy)
        traces.add(w.trace.trace)
    assert (verdict(4.0, 5.0, 1.0), verdict(7.0, 5.0, 8.0), verdict(7.0, 5.0, 1.0),
            verdict(7.0, None, 1.0)) == ("ok", "~", "MISS", "")
    runs = []
    for i, tput in enumerate((2.0, 2.1, 1.9)):
        runs.append(tmp_path / f"r{i}")
        runs[-1].mkdir()
        (runs[-1] / "summary.json").write_text(json.dumps({"request_throughput": tput}))
    errors = tmp_path / "errors.csv"
    errors.write_text("metric,real,sim,rel_error_pct,target_pct,within_target,real_min,real_max,"
                      "real_runs\nrequest_throughput,2.0,2.14,7.0,5.0,false,1.9,2.1,3\n")
    at_replay = tmp_path / "at-replay.csv"
    at_replay.write_text("metric,real,sim,rel_error_pct,target_pct,within_target,real_min,real_max,"
                       "real_runs\nrequest_throughput,2.0,2.08,4.0,5.0,true,1.9,2.1,3\n")
    rows = study_rows("conv", errors, runs, at_replay)
    assert rows[0]["spread_pct"] == pytest.approx(5.0) and rows[0]["verdict"] == "MISS"
    assert rows[0]["error_at_replay_speed_pct"] == 4.0 and rows[0]["verdict_at_replay_speed"] == "ok"
    table = format_table(rows)
    assert "0/1 targeted metrics" in table and "1/1 targeted metrics" in table
    assert "0 within target, 0 only by spread" in table and "1 within target" in table
    assert table.endswith(host_check([(rows[0]["spread_pct"], 5.0)]))
    # a spread narrower than the target leaves the verdict to the twin; a wider one is named
    assert host_check([(3.0, 10.0)]).startswith("host: no targeted metric's replays spread wider")
    assert host_check([(9.0, 5.0), (3.0, 10.0)]).startswith(
        "host: 1/2 targeted metrics' replays spread wider than their target (median 9.0%)")


def test_fidelity_study_rate_scale_slows_every_workloads_arrivals() -> None:
    """``--rate-scale`` multiplies each workload's arrival rate (time scale or request rate) and
    leaves the rest of it alone; 1 changes nothing."""
    import dataclasses

    from twinserve.benchmarks.fidelity_study import WORKLOADS, scaled

    def rate(trace) -> float:
        return trace.time_scale if trace.time_scale is not None else trace.request_rate

    for w in WORKLOADS:
        plain = scaled(w, None, 1.0)
        slow = scaled(w, 12, 0.5)
        assert plain == w, w.name
        assert rate(slow.trace) == pytest.approx(rate(w.trace) * 0.5), w.name
        assert slow.trace.num_requests == 12 and len(slow.trace.load().requests) == 12, w.name
        rest = {"time_scale": None, "request_rate": None, "num_requests": None}
        assert (dataclasses.replace(slow.trace, **rest) == dataclasses.replace(w.trace, **rest)
                and slow.engine == w.engine), w.name
    from twinserve.benchmarks.fidelity_study import main
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            main(["--rate-scale", bad, "--out", "unused"])


def test_fidelity_study_splits_the_level_between_each_rounds_replays(tmp_path: Path,
                                                                     monkeypatch) -> None:
    """The study's calibration: the grid again before each round of replays (reversed every
    other round), the engine loop's parts between them as ``loop_schedule`` places them, the
    profile saved before any workload is simulated with it."""
    from twinserve.benchmarks import fidelity_study
    from twinserve.fidelity import study
    events: list[str] = []
    weights = object()  # the calibration's model load, which every replay runs on

    class Recorded:
        runner = weights

        def time_grid_pass(self) -> None:
            events.append("grid")

        def num_loop_parts(self) -> int:
            return 3

        def measure_loop(self, parts: list[int]) -> None:
            events.append(f"loop {parts}")

        def save(self, path: Path, note: str) -> Path:
            events.append("save")
            return path

    def judge(engine, workload, runs: list[Path], profile: Path, out: Path) -> list[dict]:
        assert len(runs) == 3 and profile == tmp_path / "profile.json"
        events.append(f"sim {workload.name}")
        return [{"workload": workload.name, "metric": "request_throughput", "real": 1.0,
                 "sim": 1.0, "error_pct": 0.0, "spread_pct": 0.0, "target_pct": 5.0,
                 "verdict": "ok", "error_at_replay_speed_pct": 0.0,
                 "verdict_at_replay_speed": "ok"}]

    def replay(engine, workload, folder: Path, weights_from: object, log) -> None:
        assert weights_from is weights
        events.append(f"replay {folder.name}")

    monkeypatch.setattr(study, "_calibration", lambda engine, settings, log: Recorded())
    monkeypatch.setattr(study, "_replay_once", replay)
    monkeypatch.setattr(study, "_judge", judge)
    assert fidelity_study.main(["--out", str(tmp_path), "--workloads", "conv-600,code",
                                "--rounds", "3"]) == 0
    # every other round in reverse order, so no workload always comes first after the level
    assert events == ["grid", "loop [0, 1]", "replay conv-600-1", "loop [2]", "replay code-1",
                      "grid", "loop [2]", "replay code-2", "loop [0, 1]", "replay conv-600-2",
                      "grid", "loop [0, 1]", "replay conv-600-3", "loop [2]", "replay code-3",
                      "save", "sim conv-600", "sim code"]
    assert (tmp_path / "fidelity_study.csv").read_text().count("request_throughput") == 2


def test_the_loop_schedule_spreads_every_part_over_each_round_and_moves_it_between_rounds() -> None:
    from twinserve.fidelity.interleaved import loop_schedule
    for parts, runs in ((4, 9), (3, 2), (4, 1), (1, 9), (6, 6)):
        for round_ in range(1, 8):
            schedule = loop_schedule(parts, runs, round_)
            assert len(schedule) == runs
            assert sorted(p for slot in schedule for p in slot) == list(range(parts))
            assert max(map(len, schedule)) == -(-parts // runs)  # as even as the counts allow
    # the study's default (4 parts, 9 workloads, 5 rounds): the longest part at 5 places
    places = [next(i for i, slot in enumerate(loop_schedule(4, 9, r)) if 3 in slot)
              for r in range(1, 6)]
    assert len(set(places)) == 5
    with pytest.raises(ValueError, match="num_runs"):
        loop_schedule(4, 0, 1)
