"""A first simulation on measured ground: the default twin rests on a measured fit, and a run on a
roofline only says how far rooflines fell short where they met measurements (figures recomputed
here from the bundled data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twinserve.entrypoints.cli.main import main
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.simulator.roofline_gap import ROOFLINE_GAPS, KindGap, measure_gaps, roofline_caveat
from twinserve.traces import SyntheticConfig, synthetic_trace

TRACE = synthetic_trace(SyntheticConfig(num_requests=12, input_len=200, output_len=8, seed=3))


def test_the_quoted_gaps_are_the_bundled_datas() -> None:
    assert measure_gaps() == ROOFLINE_GAPS
    a100, h200 = ROOFLINE_GAPS
    # the roofline ran short on every kind of step of both measurements
    assert all(k.low_pct > 0 for gap in ROOFLINE_GAPS for k in gap.kinds)
    assert [k.kind for k in a100.kinds] == [k.kind for k in h200.kinds] == ["decode", "prefill",
                                                                          "mixed"]
    text = roofline_caveat()
    assert "decode 5-27% (median 20%)" in text and "simulator/data/profiles/vidur" in text
    assert "prefill 21-82% (median 77%)" in text and "simulator/data/profiles/twinserve" in text


@pytest.mark.parametrize(("field", "values"), [
    ("kind", dict(kind="swap")), ("steps", dict(steps=0)),
    ("median_pct", dict(low_pct=30.0, median_pct=20.0, high_pct=40.0))])
def test_a_kind_gap_refuses_bad_values(field: str, values: dict) -> None:
    given = dict(kind="decode", steps=3, low_pct=1.0, median_pct=2.0, high_pct=3.0) | values
    with pytest.raises(ValueError, match=field):
        KindGap(**given)


def test_the_default_twin_rests_on_a_measured_fit(tmp_path: Path) -> None:
    result = simulate(SimConfig(), TRACE)
    assert result.config.hardware == "a100-80gb" and result.config.model == "llama-3-8b"
    assert "fitted to vidur:a100/meta-llama/Meta-Llama-3-8B" in result.cost_model
    assert result.roofline_gap == ""
    folder = write_sim_run(result, tmp_path / "fit", {"trace": "synthetic"})
    assert "roofline_gap" not in json.loads((folder / "config.json").read_text())


def test_a_roofline_only_run_says_how_far_rooflines_fell_short(tmp_path: Path, capsys) -> None:
    result = simulate(SimConfig(hardware="h100-sxm"), TRACE)
    assert "roofline (uncalibrated" in result.cost_model
    assert result.roofline_gap == roofline_caveat()
    folder = write_sim_run(result, tmp_path / "roof", {"trace": "synthetic"})
    assert json.loads((folder / "config.json").read_text())["roofline_gap"] == roofline_caveat()
    assert main(["simulate", "--num-requests", "10", "--hardware", "h100-sxm", "--disable-tqdm",
                 "--out", str(tmp_path / "cli")]) == 0
    assert roofline_caveat() in capsys.readouterr().out
    assert main(["simulate", "--num-requests", "10", "--disable-tqdm",
                 "--out", str(tmp_path / "cli-default")]) == 0
    out = capsys.readouterr().out
    assert "A100-80GB: fitted to vidur:a100" in out and "roofline only" not in out
    from twinserve.reports import write_report
    page = write_report([folder, tmp_path / "cli-default"], tmp_path / "r.html").read_text()
    assert "roofline only (no measured fit)" in page and page.count("roofline only (no") == 1


def test_simulate_help_names_the_measured_default(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    from twinserve.simulator.run import DEFAULT_SIM_HARDWARE, DEFAULT_SIM_MODEL
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {DEFAULT_SIM_HARDWARE}: fitted to measured steps of Llama-3-8B" in text
    assert f"(default {DEFAULT_SIM_MODEL})" in text
