"""The real engine against itself (``reports.repeatability``) and its place in the fidelity
study's table: each real run left out in turn and judged against the others as the twin is."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from twinserve.reports.repeatability import (
    Repeatability,
    error_pct,
    format_repeatability,
    leave_one_out,
    read_repeatability,
    repeatability,
    write_repeatability,
)


def test_each_run_and_the_twin_are_judged_against_the_same_other_runs() -> None:
    # runs 1-3 each against [100, 100, 130]: median 100, spread 15%; run 4 (130) against three
    # 100s, no spread: 30% off a 5% target
    assert leave_one_out("m", [100.0, 100.0, 100.0, 130.0], 100.0, 5.0) == Repeatability(
        "m", 4, 3, 4)
    # the twin at 120: 20% off every reference, wider than every spread
    assert leave_one_out("m", [100.0, 100.0, 100.0, 130.0], 120.0, 5.0) == Repeatability(
        "m", 4, 3, 0)
    # within a spread wider than the target counts (the study's ``~``)
    # (80 and 120 left out meet medians 110 and 90 of spreads 9% and 11%: both miss by more)
    assert leave_one_out("m", [100.0, 80.0, 120.0], 110.0, 5.0) == Repeatability("m", 3, 1, 2)
    # missing values drop out; fewer than 3 runs or no twin: no judgement
    assert leave_one_out("m", [100.0, math.nan, 101.0, 99.0], 100.0, 5.0) == Repeatability(
        "m", 3, 3, 3)
    assert leave_one_out("m", [100.0, 101.0], 100.0, 5.0) is None
    assert leave_one_out("m", [100.0, 101.0, 99.0], math.nan, 5.0) is None


def test_errors_against_a_zero_reference_are_not_judged() -> None:
    assert error_pct(110.0, 100.0) == pytest.approx(10.0)
    assert error_pct(0.0, 0.0) == 0.0 and math.isnan(error_pct(1.0, 0.0))
    # [0, 0, 1]: the 1 left out meets a zero median (no verdict); the zeros meet 0.5 +- 100%
    assert leave_one_out("m", [0.0, 0.0, 1.0], 0.0, 5.0) == Repeatability("m", 3, 2, 3)


def test_repeatability_covers_the_targeted_metrics_and_round_trips(tmp_path: Path) -> None:
    reals = [{"request_throughput": v, "mean_ttft_ms": t, "p90_ttft_ms": 1.0, "mean_tpot_ms": None}
             for v, t in ((2.0, 100.0), (2.1, 140.0), (1.9, 102.0))]
    rows = repeatability(reals, {"request_throughput": 2.0, "mean_ttft_ms": 101.0})
    # p90_ttft_ms has no target; mean_tpot_ms no values; the rest no twin value
    assert [r.metric for r in rows] == ["request_throughput", "mean_ttft_ms"]
    # 2.1 and 1.9 left out miss the others' median by 7.7% and 7.3% (spreads 2.6%, 2.4%)
    assert rows[0] == Repeatability("request_throughput", 3, 1, 3)
    # 100 vs [140, 102]: -17% against a 16% spread, as the twin's 101; 140 vs [100, 102]: +39%;
    # 102 vs [100, 140]: -15% within a 17% spread, as the twin's -16%
    assert rows[1] == Repeatability("mean_ttft_ms", 3, 1, 2)
    assert repeatability(reals[:2], {"request_throughput": 2.0}) == []
    line = format_repeatability(rows)
    assert "passed 2 of 6" in line and "against the same references passed 5 of 6" in line
    assert format_repeatability([]) == ""
    path = write_repeatability(tmp_path / "repeatability.csv", rows)
    assert list(read_repeatability(path).values()) == rows
    assert read_repeatability(tmp_path / "none.csv") == {}
    with pytest.raises(ValueError, match="at least 3 runs"):
        Repeatability("m", 2, 1, 1)
    with pytest.raises(ValueError, match="twin_passes must be within 0..3"):
        Repeatability("m", 3, 1, 4)


def test_the_fidelity_study_sets_the_twin_beside_the_real_engines_repeatability(
        tmp_path: Path) -> None:
    from twinserve.benchmarks.fidelity_study import format_table, study_rows
    runs = []
    for i, tput in enumerate((2.0, 2.1, 1.9)):
        runs.append(tmp_path / f"r{i}")
        runs[-1].mkdir()
        (runs[-1] / "summary.json").write_text(json.dumps({"request_throughput": tput}))
    head = "metric,real,sim,rel_error_pct,target_pct,within_target,real_min,real_max,real_runs\n"
    for folder, sim, passes in (("twin", 2.14, 1), ("at-replay", 2.08, 3)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "errors.csv").write_text(
            f"{head}request_throughput,2.0,{sim},{100 * (sim / 2 - 1)},5.0,,1.9,2.1,3\n")
        write_repeatability(tmp_path / folder / "repeatability.csv",
                            [Repeatability("request_throughput", 3, 2, passes)])
    rows = study_rows("conv", tmp_path / "twin" / "errors.csv", runs,
                      tmp_path / "at-replay" / "errors.csv")
    assert {k: rows[0][k] for k in ("repeat_refs", "replay_passes", "twin_passes",
                                    "twin_passes_at_replay_speed")} == {
        "repeat_refs": 3, "replay_passes": 2, "twin_passes": 1, "twin_passes_at_replay_speed": 3}
    assert format_table(rows).endswith(
        "a real replay passed 2 of 3 (67%); the twin against the same references 1 of 3 (33%) "
        "as calibrated, 3 of 3 (100%) at the replays' speed")
