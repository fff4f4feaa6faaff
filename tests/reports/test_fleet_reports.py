"""Reports show fleets per replica: requests.csv names each request's replica, and a figure
sets the replicas of each run side by side (requests served, mean TTFT, prefix hit rate)."""

from __future__ import annotations

from pathlib import Path

import browser
import pytest

from twinserve.reports.figures import engine_timeseries, replica_table, replicas
from twinserve.reports.html import write_report
from twinserve.reports.runs import load_run, load_runs
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace

TRACE = multi_app_trace(MultiAppConfig(num_requests=60, request_rate=20.0, num_apps=6,
                                       input_len=64, output_len=16, seed=3))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("fleet")
    out = []
    for router in ("round-robin", "cache-aware"):
        cfg = SimConfig(hardware="h100-sxm", num_replicas=3, router=router)
        result = simulate(cfg, TRACE)
        out.append(write_sim_run(result, tmp / router, {"trace": "multi-app", "label": router}))
    lone = simulate(SimConfig(hardware="h100-sxm"), TRACE)
    out.append(write_sim_run(lone, tmp / "lone", {"trace": "multi-app", "label": "lone"}))
    return out


def test_each_request_names_the_replica_that_served_it(runs: list[Path]) -> None:
    rr, ca, lone = (load_run(p).requests for p in runs)
    by_arrival = rr.sort_values("arrival_time")["replica"].tolist()
    assert by_arrival == [0, 1, 2] * 20  # round robin, in arrival order
    assert set(ca["replica"]) <= {0, 1, 2} and len(ca) == len(TRACE)
    assert "replica" not in lone.columns  # one engine: the column is left out


def test_the_replica_table_counts_and_weighs_each_replica(runs: list[Path]) -> None:
    requests = load_run(runs[1]).requests
    table = replica_table(requests)
    assert table["requests served"].sum() == len(TRACE)
    for replica, row in table.iterrows():
        mine = requests[requests["replica"] == replica]
        assert row["mean TTFT (ms)"] == pytest.approx(mine["ttft_ms"].mean())
        assert row["prefix hit rate"] == pytest.approx(
            mine["cached_tokens"].sum() / mine["input_tokens"].sum())


def test_the_figure_has_a_bar_group_per_fleet_run(runs: list[Path]) -> None:
    loaded = load_runs(runs)
    fig = replicas(loaded)
    assert {t.name for t in fig.data} == {"round-robin [sim]", "cache-aware [sim]"}
    assert len(fig.data) == 2 * 3  # two runs, three panels
    assert replicas(loaded[2:]) is None


def test_a_fleets_engine_state_is_a_line_per_replica(runs: list[Path]) -> None:
    loaded = load_runs(runs)
    fig = engine_timeseries(loaded)
    named = [t for t in fig.data if t.showlegend]
    assert [t.name for t in named] == [f"{run} [sim], replica {k}" for run in
                                       ("round-robin", "cache-aware") for k in range(3)] + \
        ["lone [sim]"]
    assert len({t.line.dash for t in named[:3]}) == 3  # the replicas told apart
    steps = loaded[1].steps  # each line holds its replica's steps only
    for trace, (k, rows) in zip(fig.data[9:18:3], steps.groupby("replica")):
        assert trace.name == f"cache-aware [sim], replica {k}"
        assert list(trace.y) == rows.sort_values("time")["num_waiting"].tolist()


def test_the_fleet_figure_renders_in_chromium(runs: list[Path], tmp_path: Path) -> None:
    if not browser.available():
        pytest.skip(f"{browser.CHROMIUM} is missing (the project's set-up installs Debian chromium)")
    out = write_report(runs, tmp_path / "report.html")
    assert "Replicas behind a router" in out.read_text()
    shot = browser.render(out, tmp_path / "report.png")
    assert shot.console_errors == []
    expected = browser.body_attribute(shot.dom, "data-plots-expected")
    assert browser.body_attribute(shot.dom, "data-plots-rendered") == expected
    without = write_report(runs[2:], tmp_path / "lone.html").read_text()
    assert "no run has replicas behind a router." in without
