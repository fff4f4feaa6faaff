"""Reports over fabricated run folders: table values against what the records imply, the written
tables, the simulator-error table, skipped figures, and the page rendered in headless chromium."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pandas as pd
import pytest
from plotly.offline import get_plotlyjs

from twinserve.core.metrics import RequestRecord, StepRecord, jain_index, summarize
from twinserve.core.run_dir import write_run
from twinserve.reports import (
    NotARunFolderError,
    engine_timeseries,
    load_run,
    load_runs,
    sim_vs_real,
    sim_vs_real_table,
    summary_table,
    write_report,
)
from twinserve.reports.html import SECTIONS
from twinserve.reports.sampling import MAX_POINTS, decimate_mean, ecdf_points

SLOS = {"ttft": 115.0, "tpot": 13.0}  # off the fabricated values' grid
TENANTS = ("alice", "bob")


def _browser() -> ModuleType:
    """tests/browser.py, imported by path (works whether or not tests/ is a package)."""
    name = "twinserve_tests_browser"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "browser.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def make_records(n: int = 40, slow: float = 1.0, preempt_every: int = 0) -> list[RequestRecord]:
    """Requests every 0.1 s from two tenants and two priority classes; ``slow`` scales latencies."""
    records = []
    for i in range(n):
        arrival = 0.1 * i
        ttft = slow * (0.02 + 0.01 * (i % 7) + (0.05 if i % 3 == 0 else 0.0))
        out_tokens = 1 if i == 5 else 4 + i % 9
        gap = slow * (0.01 + 0.002 * (i % 4))
        itls = [gap] * (out_tokens - 1)
        first = arrival + ttft
        records.append(RequestRecord(
            request_id=f"r{i}", arrival_time=arrival, first_scheduled_time=arrival + ttft / 2,
            first_token_time=first, finish_time=first + sum(itls), input_tokens=30 + 3 * i,
            output_tokens=out_tokens, cached_tokens=16 if i % 4 == 0 else 0,
            num_preemptions=1 if preempt_every and i % preempt_every == 0 else 0,
            tenant=TENANTS[i % 2 if i < 30 else 0], priority=int(i % 3 == 0), itls=itls))
    return records


def make_steps(records: list[RequestRecord], dt: float = 0.01) -> list[StepRecord]:
    end = max(r.finish_time for r in records)
    steps = []
    for k in range(int(end / dt) + 1):
        t = k * dt
        live = [r for r in records if r.arrival_time <= t < r.finish_time]
        waiting = sum(1 for r in live if t < r.first_scheduled_time)
        tokens = {ten: (3 * sum(1 for r in live if r.tenant == ten and t < r.first_token_time),
                        sum(1 for r in live if r.tenant == ten and t >= r.first_token_time))
                  for ten in TENANTS}
        steps.append(StepRecord(
            time=t, duration=dt, num_seqs=len(live) - waiting, num_prefill_tokens=0,
            num_decode_tokens=0, num_running=len(live) - waiting, num_waiting=waiting,
            kv_usage=min(1.0, 0.05 * len(live)), num_preempted=0,
            tenant_tokens={ten: v for ten, v in tokens.items() if v != (0, 0)}))
    return steps


def make_run(root: Path, name: str, backend: str, slow: float = 1.0, steps: bool = True,
             rate: float | None = 10.0, preempt_every: int = 0, **config: object) -> Path:
    records = make_records(slow=slow, preempt_every=preempt_every)
    cfg = {"backend": backend, "label": name, "model": "smollm2-135m", "trace": "fabricated",
           **config}
    if rate is not None:
        cfg["request_rate"] = rate
    return write_run(root / name, cfg, records, summarize(records, goodput_slos_ms=SLOS),
                     make_steps(records) if steps else None)


@pytest.fixture()
def pair(tmp_path: Path) -> tuple[Path, Path]:
    sim = make_run(tmp_path, "twin", "sim", slow=1.25, preempt_every=10)
    real = make_run(tmp_path, "engine", "twinserve", slow=1.0, preempt_every=20)
    return sim, real


def test_summary_table_matches_records(pair: tuple[Path, Path]) -> None:
    records = make_records(slow=1.0, preempt_every=20)
    row = summary_table(load_runs([pair[1]])).iloc[0]
    ttft_ms = np.array([r.ttft * 1e3 for r in records])
    e2el_ms = np.array([r.e2el * 1e3 for r in records])
    assert row["run"] == "engine" and row["backend"] == "twinserve"
    assert row["mean_ttft_ms"] == pytest.approx(ttft_ms.mean())
    assert row["median_ttft_ms"] == pytest.approx(np.median(ttft_ms))
    assert row["p90_ttft_ms"] == pytest.approx(np.percentile(ttft_ms, 90))
    assert row["p99_e2el_ms"] == pytest.approx(np.percentile(e2el_ms, 99))
    tpot = [r.tpot * 1e3 for r in records if r.output_tokens > 1]
    assert row["mean_tpot_ms"] == pytest.approx(np.mean(tpot))
    itl = [g * 1e3 for r in records for g in r.itls]
    assert row["p90_itl_ms"] == pytest.approx(np.percentile(itl, 90), rel=1e-5)
    duration = max(r.finish_time for r in records)
    assert row["request_throughput"] == pytest.approx(len(records) / duration)
    assert row["output_throughput"] == pytest.approx(sum(r.output_tokens for r in records) / duration)
    assert row["num_preemptions"] == 2
    hit = sum(r.cached_tokens for r in records) / sum(r.input_tokens for r in records)
    assert row["prefix_cache_hit_rate"] == pytest.approx(hit)
    service = {t: sum(r.input_tokens + 2 * r.output_tokens for r in records if r.tenant == t)
               for t in TENANTS}
    assert row["service_alice"] == pytest.approx(service["alice"])
    assert row["service_bob"] == pytest.approx(service["bob"])
    assert row["jain_index"] == pytest.approx(jain_index(list(service.values())))
    for prio in (0, 1):
        ttft_p = np.array([r.ttft * 1e3 for r in records if r.priority == prio])
        e2el_p = np.array([r.e2el * 1e3 for r in records if r.priority == prio])
        assert row[f"prio{prio}_mean_ttft_ms"] == pytest.approx(ttft_p.mean())
        assert row[f"prio{prio}_p90_ttft_ms"] == pytest.approx(np.percentile(ttft_p, 90))
        assert row[f"prio{prio}_mean_e2el_ms"] == pytest.approx(e2el_p.mean())
        assert row[f"prio{prio}_p90_e2el_ms"] == pytest.approx(np.percentile(e2el_p, 90))


def test_goodput_from_summary_or_recomputed(pair: tuple[Path, Path]) -> None:
    records = make_records(slow=1.0, preempt_every=20)
    runs = load_runs([pair[1]])
    from_summary = summary_table(runs).iloc[0]["request_goodput"]
    assert from_summary == pytest.approx(summarize(records, goodput_slos_ms=SLOS)["request_goodput"])
    recomputed = summary_table(runs, SLOS).iloc[0]["request_goodput"]
    assert recomputed == pytest.approx(from_summary, rel=1e-6)
    strict = {"ttft": 55.0, "e2el": 151.3}
    expected = summarize(records, goodput_slos_ms=strict)["request_goodput"]
    assert summary_table(runs, strict).iloc[0]["request_goodput"] == pytest.approx(expected, rel=1e-6)
    assert 0 < expected < from_summary
    with pytest.raises(ValueError, match="slos_ms"):
        summary_table(runs, {"latency": 1.0})


def test_missing_summary_or_requests_is_a_clear_error(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    (pair[0] / "summary.json").unlink()
    with pytest.raises(NotARunFolderError, match=r"twin is not a run folder: summary.json missing"):
        load_runs([pair[1], pair[0]])
    (pair[1] / "requests.csv").unlink()
    with pytest.raises(FileNotFoundError, match="requests.csv"):
        write_report([pair[1]], tmp_path / "r.html")
    with pytest.raises(NotARunFolderError, match="no such directory"):
        load_run(tmp_path / "nowhere")


def test_sim_vs_real_errors(pair: tuple[Path, Path]) -> None:
    sim, real = load_runs(list(pair))
    errors = sim_vs_real(sim, real).set_index("metric")
    sim_rec, real_rec = make_records(slow=1.25), make_records(slow=1.0)
    ttft = (np.mean([r.ttft for r in sim_rec]), np.mean([r.ttft for r in real_rec]))
    assert errors.loc["mean_ttft_ms", "rel_error"] == pytest.approx(ttft[0] / ttft[1] - 1)
    assert errors.loc["mean_ttft_ms", "rel_error"] == pytest.approx(0.25)   # latencies all x1.25
    assert errors.loc["p90_e2el_ms", "rel_error"] == pytest.approx(0.25)
    assert errors.loc["mean_tpot_ms", "rel_error"] == pytest.approx(0.25)
    span = (max(r.finish_time for r in sim_rec), max(r.finish_time for r in real_rec))
    assert errors.loc["request_throughput", "rel_error"] == pytest.approx(span[1] / span[0] - 1)
    assert errors.loc["num_preemptions", "sim"] == 4 and errors.loc["num_preemptions", "real"] == 2
    assert errors.loc["num_preemptions", "rel_error"] == pytest.approx(1.0)
    assert errors.loc["prefix_cache_hit_rate", "rel_error"] == pytest.approx(0.0)
    assert set(errors.index) >= {"request_throughput", "mean_ttft_ms", "p90_ttft_ms",
                                 "mean_tpot_ms", "median_e2el_ms", "p90_e2el_ms"}
    assert sim_vs_real_table([real]).empty
    assert len(sim_vs_real_table([sim, real])) == len(errors)


def test_sim_paired_with_matching_real_run(tmp_path: Path) -> None:
    runs = load_runs([make_run(tmp_path, "sim2", "sim", rate=2.0),
                      make_run(tmp_path, "real4", "vllm", rate=4.0, steps=False),
                      make_run(tmp_path, "real2", "twinserve", rate=2.0),
                      make_run(tmp_path, "sim8", "sim", rate=8.0, steps=False)])
    table = sim_vs_real_table(runs)
    assert set(table["sim_run"]) == {"sim2"}          # no real run at 8 req/s: sim8 unpaired
    assert set(table["real_run"]) == {"real2"}


def test_report_writes_page_and_tables(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    out = write_report(list(pair), tmp_path / "out" / "cmp.html", slos_ms=SLOS, title="Twin vs engine")
    page = out.read_text()
    assert page.count(get_plotlyjs()[:300]) == 1      # plotly.js embedded once...
    assert "<script src" not in page                  # ...and nothing fetched: opens offline
    assert "Twin vs engine" in page and "twin [sim]" in page and "engine [twinserve]" in page
    assert 'data-plots-expected="5"' in page          # no load sweep: one request rate
    assert "Skipped: needs runs (or a sweep table)" in page
    csv = pd.read_csv(tmp_path / "out" / "cmp.csv")
    assert list(csv["run"]) == ["twin", "engine"]
    parquet = pd.read_parquet(tmp_path / "out" / "cmp.parquet")
    assert parquet["mean_ttft_ms"].tolist() == pytest.approx(csv["mean_ttft_ms"].tolist())
    errors = pd.read_csv(tmp_path / "out" / "cmp_sim_vs_real.csv")
    assert errors.loc[errors["metric"] == "mean_ttft_ms", "rel_error"].item() == pytest.approx(0.25)
    again = write_report(list(pair), tmp_path / "again" / "cmp.html", slos_ms=SLOS, title="Twin vs engine")
    assert again.read_bytes() == out.read_bytes()     # deterministic page


def test_figures_without_data_are_skipped(tmp_path: Path) -> None:
    records = [RequestRecord(f"r{i}", 0.1 * i, math.nan, 0.1 * i + 0.05, 0.1 * i + 0.2, 10, 5,
                             itls=[0.0375] * 4) for i in range(10)]
    partial = {k: v for k, v in summarize(records).items()   # a client-side summary lacks these
               if not k.startswith(("mean_", "tenant", "jain", "num_preemptions"))}
    client = write_run(tmp_path / "client", {"backend": "vllm"}, records, partial)
    out = write_report([client], tmp_path / "client.html")
    page = out.read_text()
    assert 'data-plots-expected="1"' in page           # latency CDFs only
    assert page.count("Skipped:") == len(SECTIONS) - 1
    assert "no run has steps.csv" in page and "two or more tenants" in page
    row = pd.read_csv(tmp_path / "client.csv").iloc[0]
    assert row["run"] == "client" and row["mean_ttft_ms"] == pytest.approx(50.0)  # from requests.csv
    assert row["mean_tpot_ms"] == pytest.approx(37.5)


def test_load_sweep_from_rates_or_table(tmp_path: Path) -> None:
    dirs = [make_run(tmp_path, f"sim-r{r:g}", "sim", rate=r, steps=False) for r in (2.0, 4.0, 8.0)]
    page = write_report(dirs, tmp_path / "sweep.html").read_text()
    assert "Skipped: needs runs" not in page
    sweep = pd.DataFrame({"series": ["a", "a"], "request_rate": [1, 2],
                          "request_throughput": [1.0, 1.9], "mean_ttft_ms": [10.0, 30.0]})
    page = write_report(dirs[:1], tmp_path / "table.html", sweep=sweep).read_text()
    assert "Skipped: needs runs" not in page


def test_long_series_are_decimated() -> None:
    x, y = ecdf_points(np.random.default_rng(0).exponential(size=50_000))
    assert len(x) == MAX_POINTS and y[-1] == 1.0 and np.all(np.diff(x) >= 0)
    steps = pd.DataFrame({"time": np.arange(10_000) * 0.01, "num_waiting": np.ones(10_000)})
    small = decimate_mean(steps, "time")
    assert len(small) <= MAX_POINTS and small["num_waiting"].eq(1.0).all()


def test_engine_timeseries_traces_are_small(tmp_path: Path) -> None:
    records = make_records()
    steps = [StepRecord(0.0005 * k, 0.0005, 1, 0, 1, 1, k % 5, 0.5, 0) for k in range(9000)]
    run = load_run(write_run(tmp_path / "long", {"backend": "twinserve"}, records,
                             summarize(records), steps))
    fig = engine_timeseries([run])
    assert fig is not None and len(fig.data) == 3
    assert all(len(trace.x) <= MAX_POINTS for trace in fig.data)
    assert fig.data[0].y.mean() == pytest.approx(2.0, rel=1e-3)   # mean of k % 5 survives


def test_tenant_service_uses_vtc_weights(pair: tuple[Path, Path]) -> None:
    from twinserve.reports.figures import tenant_service
    run = load_run(pair[1])
    service = tenant_service(run.tenants)
    raw = pd.read_csv(pair[1] / "tenants.csv")
    assert service["service"].sum() == pytest.approx(
        (raw["prefill_tokens"] + 2 * raw["output_tokens"]).sum())


def test_reports_import_no_backend() -> None:
    code = ("import sys, twinserve.reports; "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or "
            "m.startswith(('twinserve.simulator', 'twinserve.gpu'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_report_renders_in_chromium(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    browser = _browser()
    if not browser.available():
        pytest.skip(f"{browser.CHROMIUM} is missing (the project's set-up installs Debian chromium)")
    extra = make_run(tmp_path, "twin-r20", "sim", slow=1.6, rate=20.0)
    out = write_report([*pair, extra], tmp_path / "report.html", slos_ms=SLOS)
    shot = browser.render(out, tmp_path / "report.png")
    assert shot.console_errors == []
    expected = browser.body_attribute(shot.dom, "data-plots-expected")
    assert expected == "6"
    assert browser.body_attribute(shot.dom, "data-plots-rendered") == expected
    info = browser.png_info(shot.screenshot)
    assert (info.width, info.height) == (1400, 3000)
    assert shot.screenshot.stat().st_size > 50_000
    assert info.distinct_rows > 100 and info.distinct_bytes > 50


def test_browser_helper_reports_console_errors(tmp_path: Path) -> None:
    browser = _browser()
    if not browser.available():
        pytest.skip(f"{browser.CHROMIUM} is missing (the project's set-up installs Debian chromium)")
    page = tmp_path / "bad.html"
    page.write_text("<html><head></head><body><p>x</p><script>console.log('all good');"
                    "console.error('boom'); notDefined();</script></body></html>")
    shot = browser.render(page, tmp_path / "bad.png", width=400, height=300)
    assert any("boom" in e for e in shot.console_errors)
    assert any("Uncaught ReferenceError" in e for e in shot.console_errors)
    assert not any("all good" in e for e in shot.console_errors)


def test_report_lists_the_engine_keys_that_differ(tmp_path: Path) -> None:
    from twinserve.reports.runs import load_runs
    from twinserve.reports.tables import config_differences
    a = make_run(tmp_path, "a", "sim", max_num_seqs=256, block_size=16, dtype="bfloat16",
                 policy_options={"w": 1})
    b = make_run(tmp_path, "b", "sim", max_num_seqs=64, block_size=16, dtype="bfloat16",
                 policy_options={"w": 2}, num_replicas=2)
    diff = config_differences(load_runs([a, b]))
    assert list(diff["key"]) == ["policy_options", "max_num_seqs", "num_replicas"]
    row = diff.set_index("key").loc["max_num_seqs"]
    assert list(row) == [256, 64]
    page = write_report([a, b], tmp_path / "r.html").read_text()
    assert "Engine configuration: what differs" in page and "num_replicas" in page
    same = write_report([a, a], tmp_path / "s.html").read_text()
    assert "Every run has the same engine configuration." in same


# ---- the demo's two stories: policies in simulation, the twin against the real engine -------
def _stories(root: Path) -> tuple[list[Path], list[Path], list]:
    from twinserve.reports.stories import TwinRun
    policies = [make_run(root, f"p-{p}", "sim", slow=s, hardware="a100-80gb", scheduling_policy=p)
                for p, s in (("fcfs", 1.0), ("fair", 1.1))]
    reals = [make_run(root, f"r{i}", "twinserve", slow=s, scheduling_policy="fcfs",
                      device_type="cpu", label="real fcfs") for i, s in enumerate((1.0, 1.04, 0.97))]
    twins = [TwinRun(make_run(root, "t", "sim", slow=1.25, scheduling_policy="fcfs",
                              hardware=str(root / "profile.json"), label="sim fcfs")),
             TwinRun(make_run(root, "t-fast", "sim", slow=1.02, scheduling_policy="fcfs",
                              label="sim fcfs"), "at the replays' speed")]
    return policies, reals, twins


def test_story_pages_name_runs_by_role_and_judge_the_twin_as_validate_does(tmp_path: Path) -> None:
    from twinserve.reports.fidelity import error_rows
    from twinserve.reports.stories import judge, write_story_pages
    policies, reals, twins = _stories(tmp_path)
    pages = write_story_pages(tmp_path / "out" / "report.html", policies, reals, twins, SLOS)
    index = pages.index
    assert [j.run.name for j in pages.judged] == ["twin cpu fcfs",
                                                  "twin cpu fcfs (at the replays' speed)"]
    pages = {name: (tmp_path / "out" / name).read_text() for name in
             ("report.html", "policies.html", "twin-vs-real.html")}
    assert ">sim a100-80gb fcfs<" in pages["policies.html"] and "real cpu" not in pages["policies.html"]
    twin_page = pages["twin-vs-real.html"]
    assert "sim a100-80gb" not in twin_page and ">sim fcfs<" not in twin_page
    for name in ("real cpu fcfs #1", "real cpu fcfs #3", "twin cpu fcfs",
                 "twin cpu fcfs (at the replays&#x27; speed)"):
        assert f">{name}<" in twin_page
    # the judgement is validate's: the twin against the median and spread of the three replays
    loaded = load_runs(reals)
    expected = {r["metric"]: r for r in error_rows([r.summary for r in loaded],
                                                   load_run(twins[0].path).summary)}
    judged = judge(loaded, load_run(twins[0].path))
    row = next(r for r in judged.rows if r["metric"] == "mean_ttft_ms")
    ttfts = sorted(r.summary["mean_ttft_ms"] for r in loaded)
    assert row["real"] == pytest.approx(ttfts[1]) == pytest.approx(expected["mean_ttft_ms"]["real"])
    assert (row["real_min"], row["real_max"]) == (ttfts[0], ttfts[2])
    assert row["rel_error_pct"] == pytest.approx(25.0, abs=3) and row["verdict"] == "MISS"
    assert {r["metric"] for r in judged.rows} >= {"mean_ttft_ms[alice]", "mean_ttft_ms[bob]"}
    assert judged.verdicts["MISS"] >= 2 and "MISS" in twin_page
    near = judge(loaded, load_run(twins[1].path))
    assert next(r for r in near.rows if r["metric"] == "mean_ttft_ms")["verdict"] in ("ok", "~")
    counts = judged.verdicts
    assert (f"twin cpu fcfs: {counts['ok']} of {sum(counts.values())} targeted metrics within "
            f"target, {counts['~']} within") in index.read_text()
    errors = pd.read_csv(tmp_path / "out" / "twin-vs-real_errors.csv")
    assert set(errors["twin"]) == {"twin cpu fcfs", "twin cpu fcfs (at the replays' speed)"}


def test_story_pages_refuse_runs_in_the_wrong_role(tmp_path: Path) -> None:
    from twinserve.reports.stories import TwinRun, write_story_pages
    policies, reals, twins = _stories(tmp_path)
    with pytest.raises(ValueError, match="real_runs: .* is not a real run"):
        write_story_pages(tmp_path / "r.html", policies, [twins[0].path], twins)
    with pytest.raises(ValueError, match="policy_runs: .* is not a simulator run"):
        write_story_pages(tmp_path / "r.html", [reals[0]], reals, twins)
    with pytest.raises(ValueError, match="twin_runs: .* is not a simulator run"):
        write_story_pages(tmp_path / "r.html", policies, reals, [TwinRun(reals[0])])
    with pytest.raises(ValueError, match="give both or neither"):
        write_story_pages(tmp_path / "r.html", policies, reals, [])
    only = write_story_pages(tmp_path / "only" / "report.html", policies, [], [])
    assert only.policies == tmp_path / "only" / "policies.html" and only.policies.is_file()
    assert only.twin is None and not (tmp_path / "only" / "twin-vs-real.html").exists()
    assert only.index.is_file() and only.judged == ()


def test_story_pages_render_in_chromium(tmp_path: Path) -> None:
    browser = _browser()
    if not browser.available():
        pytest.skip(f"{browser.CHROMIUM} is missing (the project's set-up installs Debian chromium)")
    from twinserve.reports.stories import write_story_pages
    index = write_story_pages(tmp_path / "out" / "report.html", *_stories(tmp_path), SLOS).index
    # index: no figure; policies: CDFs, load sweep skipped (one rate), engine, fairness,
    # priority; the twin page: its error figure and the same four
    for name, plots in (("report.html", "0"), ("policies.html", "4"), ("twin-vs-real.html", "5")):
        shot = browser.render(index.parent / name, tmp_path / f"{name}.png")
        assert shot.console_errors == [], name
        assert browser.body_attribute(shot.dom, "data-plots-expected") == plots, name
        assert browser.body_attribute(shot.dom, "data-plots-rendered") == plots, name
        assert 'href="policies.html"' in shot.dom and 'href="twin-vs-real.html"' in shot.dom
        assert browser.png_info(shot.screenshot).distinct_rows > 50, name


def test_story_pages_tell_the_twin_story_alone_into_a_new_folder(tmp_path: Path) -> None:
    from twinserve.reports.stories import write_story_pages
    _, reals, twins = _stories(tmp_path)
    pages = write_story_pages(tmp_path / "new" / "deeper" / "report.html", [], reals, twins[:1])
    assert pages.policies is None and pages.twin is not None and pages.twin.is_file()
    assert "Policies in simulation" not in pages.index.read_text()
    assert "repeatability: each real run" in pages.twin.read_text()
