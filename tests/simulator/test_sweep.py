"""simulator/sweep (and the sweep command): a 2x2 grid run locally and on Ray gives identical
numbers, resuming reruns nothing, capacity on hand-made curves, and spec errors that name the key
and the file."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from twinserve.entrypoints.cli.sweep import add_sweep_args, run_sweep_cli, sweep_and_report
from twinserve.simulator.capacity import capacity_of, find_capacity
from twinserve.simulator.sweep import run_sweep
from twinserve.simulator.sweep_spec import SweepSpec, load_spec, mean_rate, parse_spec, point_trace
from twinserve.traces import TraceRequest, load_trace

SPEC = """\
[sweep]
title = "test sweep"

[workload]
trace = "azure-conv"
num_requests = 60
tenants = { heavy = 0.8, light = 0.2 }

[engine]
model = "llama-3-8b"
hardware = "a100-80gb"

[grid]
scheduling_policy = ["fcfs", "fair"]
request_rate = [8.0, 32.0]

[slo]
ttft_ms = 300
tpot_ms = 40
target = 0.9
"""
METRICS = ("completed", "duration", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p90_e2el_ms",
           "request_throughput", "output_throughput", "num_preemptions", "jain_index",
           "slo_attainment", "request_goodput", "tenant_light_mean_ttft_ms")


def _spec_file(tmp_path: Path, text: str = SPEC, name: str = "spec.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _mtimes(out: Path) -> dict[str, int]:
    points = out / "points"
    return {str(p.relative_to(points)): p.stat().st_mtime_ns for p in points.rglob("*")}


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, pd.DataFrame]:
    tmp = tmp_path_factory.mktemp("sweep")
    spec = _spec_file(tmp)
    out = tmp / "local"
    return spec, out, sweep_and_report(spec, out, backend="local", workers=2, progress=False)


@pytest.fixture()
def ray_cluster() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


# ---------------------------------------------------------------- running


def test_local_sweep_writes_every_output(local_sweep: tuple[Path, Path, pd.DataFrame]) -> None:
    _, out, sweep = local_sweep
    assert len(sweep) == 4 and sweep.attrs["points_run"] == 4
    assert set(sweep["scheduling_policy"]) == {"fcfs", "fair"}
    assert sorted(set(sweep["request_rate"])) == [8.0, 32.0]
    assert (sweep["completed"] == 60).all() and (sweep["num_requests_run"] == 60).all()
    assert sweep["point_id"].is_unique
    for name in ("sweep.csv", "capacity.csv", "report.html", "sweep_spec.json"):
        assert (out / name).is_file(), name
    assert len(list((out / "points").iterdir())) == 4  # no temporary folder left behind
    written = pd.read_csv(out / "sweep.csv")
    pd.testing.assert_series_equal(written["mean_ttft_ms"], sweep["mean_ttft_ms"])
    capacity = pd.read_csv(out / "capacity.csv")
    assert set(capacity["series"]) == {"fcfs", "fair"}


def test_ray_matches_local(local_sweep: tuple[Path, Path, pd.DataFrame], ray_cluster: None,
                           tmp_path: Path) -> None:
    spec, _, local = local_sweep
    remote = run_sweep(spec, tmp_path / "ray", backend="ray", progress=False)
    assert remote.attrs["points_run"] == 4
    key = ["point_id"]
    pd.testing.assert_frame_equal(local.sort_values(key)[[*key, *METRICS]].reset_index(drop=True),
                                  remote.sort_values(key)[[*key, *METRICS]].reset_index(drop=True))


def test_resume_reruns_nothing(local_sweep: tuple[Path, Path, pd.DataFrame]) -> None:
    spec, out, first = local_sweep
    before = _mtimes(out)
    again = run_sweep(spec, out, workers=1, progress=False)
    assert again.attrs["points_run"] == 0
    assert _mtimes(out) == before
    pd.testing.assert_frame_equal(first, again)


def test_resume_runs_only_new_or_incomplete_points(local_sweep: tuple[Path, Path, pd.DataFrame],
                                                   tmp_path: Path) -> None:
    spec, done, _ = local_sweep
    out = tmp_path / "out"
    shutil.copytree(done, out)
    broken = sorted((out / "points").iterdir())[0]
    (broken / "summary.json").unlink()  # as if killed while writing
    before = _mtimes(out)
    grown = _spec_file(tmp_path, SPEC.replace("[8.0, 32.0]", "[8.0, 32.0, 16.0]"))
    sweep = run_sweep(grown, out, workers=1, progress=False)
    assert sweep.attrs["points_run"] == 3  # the broken point and the two at the new rate
    after = _mtimes(out)
    kept = [k for k in before if not k.startswith(broken.name)]
    assert all(after[k] == before[k] for k in kept)
    assert len(sweep) == 6


def test_cli_reports_bad_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_sweep_args(parser)
    spec = _spec_file(tmp_path, SPEC.replace("[engine]", "[engine]\nmax_num_seq = 3"))
    args = parser.parse_args([str(spec), "--out", str(tmp_path / "o")])
    assert run_sweep_cli(args) == 2
    err = capsys.readouterr().err
    assert "max_num_seq" in err and "spec.toml" in err and "max_num_seqs" in err


# ---------------------------------------------------------------- capacity


def test_capacity_interpolates_between_grid_rates() -> None:
    got = capacity_of([2, 4, 6, 8], [1.0, 0.95, 0.85, 0.2], target=0.9)
    assert got["max_rate_meeting_slo"] == 4.0
    assert got["capacity_rps"] == pytest.approx(4 + (0.95 - 0.9) / (0.95 - 0.85) * 2)  # 5.0
    assert got["status"] == "interpolated"


def test_capacity_edges() -> None:
    every = capacity_of([1, 2], [1.0, 0.9], target=0.9)
    assert every["capacity_rps"] == 2.0 and every["status"].startswith("lower bound")
    none = capacity_of([1, 2], [0.5, 0.1], target=0.9)
    assert math.isnan(none["capacity_rps"]) and math.isnan(none["max_rate_meeting_slo"])
    # not monotone: the highest rate that meets the target counts (as Vidur-Search's max QPS)
    bumpy = capacity_of([1, 2, 3, 4], [0.95, 0.8, 0.92, 0.5], target=0.9)
    assert bumpy["max_rate_meeting_slo"] == 3.0
    assert bumpy["capacity_rps"] == pytest.approx(3 + 0.02 / 0.42)


def test_find_capacity_per_configuration() -> None:
    df = pd.DataFrame({
        "policy": ["a"] * 3 + ["b"] * 3 + ["c"] * 3,
        "request_rate": [30.0, 10.0, 20.0] * 3,  # unsorted on purpose
        "slo_attainment": [0.5, 1.0, 0.9,   0.95, 1.0, 0.99,   0.1, 0.6, 0.3],
    })
    cap = find_capacity(df, target=0.9, group_cols=["policy"]).set_index("policy")
    assert cap.loc["a", "max_rate_meeting_slo"] == 20.0
    assert cap.loc["a", "capacity_rps"] == pytest.approx(20.0)  # exactly at target
    assert cap.loc["b", "capacity_rps"] == 30.0 and cap.loc["b", "status"].startswith("lower bound")
    assert math.isnan(cap.loc["c", "capacity_rps"])
    whole = find_capacity(df[df["policy"] == "a"], target=0.75, group_cols=[])
    assert len(whole) == 1 and whole["capacity_rps"].iloc[0] == pytest.approx(20 + 0.15 / 0.4 * 10)
    with pytest.raises(ValueError, match="slo_attainment"):
        find_capacity(df.drop(columns="slo_attainment"), 0.9, ["policy"])


# ---------------------------------------------------------------- the spec


@pytest.mark.parametrize(("edit", "key"), [
    (("[engine]", "[engine]\nmax_num_seq = 128"), "max_num_seq"),
    (("[grid]", "[grid]\nmax_num_seq = [128]"), "max_num_seq"),
    (("[grid]", "[grid]\nmax_num_seqs = 128"), "max_num_seqs"),
    (("[grid]", "[grid]\nmax_num_seqs = [128, 128]"), "max_num_seqs"),
    (("[engine]", "[engine]\nmax_num_seqs = \"many\""), "max_num_seqs"),
    (("[engine]", "[engine]\npolicy_options = {}"), "policy_options"),
    (("[engine]", "[engine]\ngpu_memory_utilization = 1.5"), "gpu_memory_utilization"),
    (("[engine]", "[engine]\nscheduling_policy = \"lifo\""), "scheduling_policy"),
    (('hardware = "a100-80gb"', 'hardware = "tpu"'), "hardware"),
    (("[workload]", "[workload]\nnum_request = 5"), "num_request"),
    (("num_requests = 60", "num_requests = 0"), "num_requests"),
    (("[workload]", "[workload]\ninput_len = 64"), "input_len"),
    (("[workload]", "[workload]\nnum_apps = 4"), "num_apps"),  # (multi-app's alone)
    (('trace = "azure-conv"', 'trace = "multi-app"\nsystem_len_min = 90\nsystem_len_max = 80'),
     "system_len_max"),
    (('trace = "azure-conv"', 'trace = "multi-app"\nzipf_s = -1'), "zipf_s"),
    (('trace = "azure-conv"', 'trace = "multi-app"\nprefix_len = 8'), "prefix_len"),
    (("[workload]", "[workload]\ntime_window = [5, 1]"), "time_window"),
    (("[workload]", "[workload]\npriorities = { high = 1 }"), "priorities"),
    (("[workload]", "[workload]\nrequest_rate = 3"), "request_rate"),
    (("target = 0.9", "target = 1.5"), "target"),
    (("tpot_ms = 40", "tpot_ms = -1"), "tpot_ms"),
    (("[slo]", "[slo]\nitl_ms = 5"), "itl_ms"),
    (("[sweep]", "[sweeps]"), "sweeps"),
    (("[slo]", "[policy_options.fair]\nw_inn = 1\n[slo]"), "fair"),
    (("[slo]", "[policy_options.lifo]\n[slo]"), "lifo"),
])
def test_spec_errors_name_key_and_file(tmp_path: Path, edit: tuple[str, str], key: str) -> None:
    path = _spec_file(tmp_path, SPEC.replace(*edit, 1), name="bad_spec.toml")
    with pytest.raises(ValueError) as info:
        load_spec(path)
    message = str(info.value)
    assert key in message and "bad_spec.toml" in message, message


def test_spec_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothere.toml"):
        load_spec(tmp_path / "nothere.toml")
    with pytest.raises(ValueError, match="broken.toml.*TOML"):
        load_spec(_spec_file(tmp_path, "[grid\n", name="broken.toml"))


def test_point_ids_are_stable_and_follow_the_config() -> None:
    spec = parse_spec(_toml(SPEC))
    ids = [p.point_id for p in spec.points()]
    assert len(set(ids)) == 4 and ids == [p.point_id for p in parse_spec(_toml(SPEC)).points()]
    # writing a default out, or reordering the grid, changes no point's id
    same = parse_spec(_toml(SPEC.replace("[engine]", "[engine]\nmax_num_seqs = 256")))
    assert {p.point_id for p in same.points()} == set(ids)
    other = parse_spec(_toml(SPEC.replace("[engine]", "[engine]\nmax_num_seqs = 128")))
    assert not {p.point_id for p in other.points()} & set(ids)
    names = [p.folder for p in spec.points()]
    assert names[0].startswith("fcfs_rate8-") and names[-1].startswith("fair_rate32-")


def test_point_trace_applies_rate_and_tenant_priorities() -> None:
    text = SPEC.replace("tenants = {", "tenant_priorities = { light = 0, heavy = 1 }\ntenants = {")
    spec = parse_spec(_toml(text))
    point = spec.points()[1]  # fcfs at 32 req/s
    trace = point_trace(point.workload, _load(point.workload["trace"]))
    assert len(trace) == 60 and mean_rate(trace) == pytest.approx(32.0)
    assert {(r.tenant, r.priority) for r in trace} == {("light", 0), ("heavy", 1)}


def test_synthetic_workload_uses_its_own_rate() -> None:
    text = SPEC.replace('trace = "azure-conv"', 'trace = "synthetic"\ninput_len = 64\noutput_len = 8')
    point = parse_spec(_toml(text)).points()[0]
    trace = point_trace(point.workload, None)
    assert len(trace) == 60 and {r.input_tokens for r in trace} == {64}
    assert 5.0 < mean_rate(trace) < 12.0  # Poisson at 8 req/s over 60 requests


def test_multi_app_workload_is_generated_from_its_keys() -> None:
    """``trace = "multi-app"`` (the workload routers are compared on): its keys, at each
    point's rate, and its applications as the tenants."""
    from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace
    keys = "num_apps = 5\nzipf_s = 0.5\nsystem_len_min = 64\nsystem_len_max = 96\ninput_len = 32"
    text = SPEC.replace('trace = "azure-conv"', f'trace = "multi-app"\n{keys}').replace(
        "tenants = { heavy = 0.8, light = 0.2 }\n", "")
    points = parse_spec(_toml(text)).points()
    trace = point_trace(points[1].workload, None)  # fcfs at 32 req/s
    assert trace == multi_app_trace(MultiAppConfig(
        num_requests=60, request_rate=32.0, num_apps=5, zipf_s=0.5, system_len_min=64,
        system_len_max=96, input_len=32))
    assert {r.tenant for r in trace} <= {f"app-{k}" for k in range(5)}
    other = parse_spec(_toml(text.replace("num_apps = 5", "num_apps = 6"))).points()
    assert not {p.point_id for p in other} & {p.point_id for p in points}


def _toml(text: str) -> dict:
    return tomllib.loads(text)


def _load(name: str) -> list[TraceRequest]:
    return load_trace(name)


def test_run_sweep_rejects_bad_arguments(tmp_path: Path) -> None:
    spec: SweepSpec = parse_spec(_toml(SPEC), "inline")
    with pytest.raises(ValueError, match="backend"):
        run_sweep(spec, tmp_path, backend="dask", progress=False)
    with pytest.raises(ValueError, match="workers"):
        run_sweep(spec, tmp_path, workers=0, progress=False)
    with pytest.raises(ValueError, match="address"):
        run_sweep(spec, tmp_path, address="auto", progress=False)
    assert os.listdir(tmp_path) == []


def test_engine_table_may_start_from_a_config_file(tmp_path: Path) -> None:
    from twinserve.simulator.sweep_spec import load_spec
    (tmp_path / "base.yaml").write_text("max-num-seqs: 64\nblock-size: 32\n")
    spec_file = tmp_path / "spec.toml"
    spec_file.write_text(SPEC.replace("[engine]", '[engine]\nconfig = "base.yaml"\nblock_size = 8'))
    points = load_spec(spec_file).points()
    assert {(p.sim["max_num_seqs"], p.sim["block_size"]) for p in points} == {(64, 8)}
    (tmp_path / "base.yaml").write_text("max-num-seq: 64\n")
    with pytest.raises(ValueError, match="max_num_seq"):
        load_spec(spec_file)
