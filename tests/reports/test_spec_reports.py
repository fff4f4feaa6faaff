"""Run comparison reports show speculation: acceptance length and TPOT speedup over the run
without speculation of the same trace and rate, in the table and in a figure that renders."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pandas as pd
import pytest

from twinserve.core.engine_args import EngineArgs
from twinserve.reports.html import write_report
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.traces import SyntheticConfig, synthetic_trace

TRACE = synthetic_trace(SyntheticConfig(num_requests=40, input_len=200, output_len=100,
                                        request_rate=2.0, seed=4))


def sim_run(tmp_path: Path, name: str, rate: float | None, policy: str = "fixed") -> Path:
    spec = None if rate is None else {
        "method": "ngram", "num_speculative_tokens": 4, "policy": policy,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": rate}
    result = simulate(SimConfig(EngineArgs(speculative_config=spec, max_num_seqs=16)), TRACE)
    return write_sim_run(result, tmp_path / name,
                         {"trace": "synthetic", "request_rate": 2.0, "label": name})


def _browser() -> ModuleType:
    name = "twinserve_tests_browser"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "browser.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("spec")
    return [sim_run(tmp, "none", None), sim_run(tmp, "k4-high", 0.9), sim_run(tmp, "k4-low", 0.1)]


def test_table_has_acceptance_length_and_speedup(runs: list[Path], tmp_path: Path) -> None:
    out = write_report(runs, tmp_path / "report.html")
    table = pd.read_csv(tmp_path / "report.csv").set_index("run")
    assert pd.isna(table.loc["none", "spec_mean_acceptance_length"])
    high, low = table.loc["k4-high"], table.loc["k4-low"]
    assert high["spec_mean_acceptance_length"] > 3.5 > 1.5 > low["spec_mean_acceptance_length"]
    assert high["spec_tpot_speedup"] == pytest.approx(
        table.loc["none", "mean_tpot_ms"] / high["mean_tpot_ms"])
    assert low["spec_tpot_speedup"] == pytest.approx(
        table.loc["none", "mean_tpot_ms"] / low["mean_tpot_ms"])
    assert high["spec_tpot_speedup"] > 1.5 > 1.1 > low["spec_tpot_speedup"]
    page = out.read_text()
    assert "Speculative decoding" in page and "no run verified draft tokens" not in page


def test_speculation_figure_renders_in_chromium(runs: list[Path], tmp_path: Path) -> None:
    browser = _browser()
    if not browser.available():
        pytest.skip(f"{browser.CHROMIUM} is missing (the project's set-up installs Debian chromium)")
    out = write_report(runs, tmp_path / "report.html")
    shot = browser.render(out, tmp_path / "report.png")
    assert shot.console_errors == []
    expected = browser.body_attribute(shot.dom, "data-plots-expected")
    assert int(expected) >= 2  # latency CDFs, the speculation figure, ...
    assert browser.body_attribute(shot.dom, "data-plots-rendered") == expected
    without = write_report(runs[:1], tmp_path / "plain.html").read_text()
    assert "no run verified draft tokens" in without
