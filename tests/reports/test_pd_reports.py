"""Run comparison reports show disaggregated runs: pool utilisation and the TTFT parts in the
table, and a figure with them; aggregated runs leave those cells empty."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from twinserve.reports.figures import disaggregation
from twinserve.reports.html import write_report
from twinserve.reports.runs import load_runs
from twinserve.reports.tables import summary_table
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.traces import SyntheticConfig, synthetic_trace

TRACE = synthetic_trace(SyntheticConfig(num_requests=30, input_len=400, output_len=20,
                                        request_rate=5.0, seed=5))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("pd")
    out = []
    for name, pools in (("agg", {}), ("1p1d", {"prefill_instances": 1, "decode_instances": 1})):
        result = simulate(SimConfig(hardware="h100-sxm", max_num_seqs=16, **pools), TRACE)
        out.append(write_sim_run(result, tmp / name, {"trace": "synthetic", "label": name}))
    return out


def test_the_table_holds_the_pools_and_the_ttft_parts(runs: list[Path], tmp_path: Path) -> None:
    out = write_report(runs, tmp_path / "report.html")
    table = pd.read_csv(tmp_path / "report.csv").set_index("run")
    assert pd.isna(table.loc["agg", "mean_ttft_transfer_ms"])
    pd_row = table.loc["1p1d"]
    parts = sum(pd_row[f"mean_ttft_{p}_ms"] for p in ("queue", "prefill", "transfer", "decode"))
    assert parts == pytest.approx(pd_row["mean_ttft_ms"], rel=1e-6)
    assert 0 < pd_row["prefill_utilization"] < 1 and pd_row["mean_kv_transfer_ms"] > 0
    assert "Disaggregated prefill and decode" in out.read_text()


def test_the_figure_stacks_the_parts_of_disaggregated_runs_only(runs: list[Path]) -> None:
    table = summary_table(load_runs(runs))
    fig = disaggregation(table)
    bars = [t for t in fig.data if t.type == "bar"]
    assert len(bars) == 4 and all(list(b.x) == ["1p1d"] for b in bars)
    assert disaggregation(table[table["run"] == "agg"]) is None
