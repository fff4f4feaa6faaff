"""``twinserve sweep SPEC.toml``: simulate a grid of configurations, find each one's capacity, report.

    OUT/
      sweep_spec.json        the validated spec
      points/<name>-<id>/    one run folder per grid point (``core.run_dir``); id = hash of its config
      sweep.csv              one row per point: config columns, summary metrics, SLO attainment
      capacity.csv           per configuration: the highest request rate meeting the SLO target
      report.html            ``reports.write_report`` over representative points, with the sweep table

Points run in parallel, in local processes (default) or as Ray tasks. A point whose folder already
holds a complete run of the same config is not rerun, so an interrupted or extended sweep resumes:
each point is written to a temporary folder and renamed into place when complete.

Capacity (as Vidur-Search defines it): the highest request rate at which the fraction of requests
meeting every SLO (``slo_attainment``) is at least the target; between that grid rate and the next
one (which misses), the crossing is interpolated linearly.

``twinserve.reports`` (plotly) and ``ray`` are imported inside the functions that use them, so that
worker processes, which import this module to run points, load neither.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from twinserve.entrypoints.sweep_spec import (SloSpec, SweepPoint, SweepSpec, base_trace, load_spec,
                                              mean_rate, point_trace)
from twinserve.core.engine_args import EngineArgs
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.traces import TraceRequest

BACKENDS = ("local", "ray")
POINTS_DIR = "points"
REPORT_ALL_MAX = 8  # a sweep of at most this many points is reported whole
CAPACITY_COLUMNS = ("capacity_rps", "max_rate_meeting_slo", "attainment_at_capacity", "status")
TENANT_TTFT_PERCENTILE = 90


@dataclass(frozen=True, slots=True)
class PointTask:
    """What a worker needs to run one point (picklable: plain data and the point's requests)."""

    point_id: str
    folder: str
    sim: dict[str, Any]
    label: str
    trace: list[TraceRequest]
    trace_desc: dict[str, Any]


@dataclass(frozen=True, slots=True)
class PointDone:
    point_id: str
    wall_time_s: float


# ---------------------------------------------------------------- one point


def run_point(task: PointTask) -> PointDone:
    """Simulates one point and writes its run folder atomically (temporary folder, then rename)."""
    result = simulate(SimConfig.from_flat({**task.sim, "label": task.label}), task.trace)
    final = Path(task.folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        write_sim_run(result, tmp, task.trace_desc)
        if final.exists():  # an incomplete or stale run of the same name
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return PointDone(task.point_id, result.wall_time_s)


def is_complete(folder: Path, point_id: str) -> bool:
    """Whether ``folder`` holds a complete run of the point ``point_id``."""
    if not all((folder / name).is_file() for name in ("config.json", "summary.json", "requests.csv")):
        return False
    try:
        config = json.loads((folder / "config.json").read_text())
        json.loads((folder / "summary.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return config.get("sweep_point_id") == point_id


def build_tasks(spec: SweepSpec, points: Sequence[SweepPoint], points_dir: Path) -> list[PointTask]:
    """Each point's requests, cut from its trace (each trace file is read once)."""
    bases: dict[str, list[TraceRequest] | None] = {}
    tasks = []
    for point in points:
        trace_name = point.workload["trace"]
        try:
            if trace_name not in bases:
                bases[trace_name] = base_trace(point.workload)
            trace = point_trace(point.workload, bases[trace_name])
        except ValueError as exc:
            raise ValueError(f"{spec.source}: point {point.name!r}: {exc}") from None
        tasks.append(PointTask(point.point_id, str(points_dir / point.folder), point.sim, point.name,
                               trace, _trace_desc(point, trace)))
    return tasks


def _trace_desc(point: SweepPoint, trace: list[TraceRequest]) -> dict[str, Any]:
    """What the run folder's config records besides the SimConfig fields."""
    policy = point.sim.get("scheduling_policy", EngineArgs().scheduling_policy)
    return {**point.workload, "policy": policy,
            "trace_request_rate": mean_rate(trace), "num_requests_run": len(trace),
            "sweep_point_id": point.point_id, "sweep_point_name": point.name,
            "sweep_series": point.series}


# ---------------------------------------------------------------- running many


def execute(tasks: list[PointTask], backend: str, workers: int | None, address: str | None,
            on_done: Callable[[PointDone], None]) -> None:
    """Runs the tasks on the backend, calling ``on_done`` as each finishes."""
    if not tasks:
        return
    if backend == "ray":
        _run_ray(tasks, address, workers, on_done)
    else:
        _run_local(tasks, workers or os.cpu_count() or 1, on_done)


def _run_local(tasks: list[PointTask], workers: int, on_done: Callable[[PointDone], None]) -> None:
    if workers == 1 or len(tasks) == 1:
        for task in tasks:
            on_done(_named(task, lambda: run_point(task)))
        return
    # spawn, not fork: the parent may hold threads (tqdm's monitor, a Ray driver).
    pool = ProcessPoolExecutor(max_workers=min(workers, len(tasks)),
                               mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {pool.submit(run_point, task): task for task in tasks}
        for future in as_completed(futures):
            on_done(_named(futures[future], future.result))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _run_ray(tasks: list[PointTask], address: str | None, workers: int | None,
             on_done: Callable[[PointDone], None]) -> None:
    import ray  # optional dependency: pip install twinserve[ray]

    started = not ray.is_initialized()
    if started:
        ray.init(address=address or "local", num_cpus=workers if address is None else None,
                 include_dashboard=False, configure_logging=False)
    pending: dict[Any, PointTask] = {}
    try:
        remote = ray.remote(num_cpus=1)(run_point)
        pending.update({remote.remote(task): task for task in tasks})
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            task = pending.pop(done[0])
            on_done(_named(task, lambda: ray.get(done[0])))
    finally:
        for ref in pending:
            ray.cancel(ref)
        if started:
            ray.shutdown()


def _named(task: PointTask, result: Callable[[], PointDone]) -> PointDone:
    """``result()``, with the folder of the point it belongs to noted on any error."""
    try:
        return result()
    except Exception as exc:
        exc.add_note(f"while running sweep point {task.folder}")
        raise


# ---------------------------------------------------------------- collecting


def point_row(point: SweepPoint, folder: Path, slo: SloSpec | None) -> dict[str, Any]:
    """One sweep.csv row: the point's config, its summary metrics and its SLO attainment."""
    config = json.loads((folder / "config.json").read_text())
    summary = json.loads((folder / "summary.json").read_text())
    requests = pd.read_csv(folder / "requests.csv", usecols=["tenant", "success", "ttft_ms",
                                                              "tpot_ms", "e2el_ms"])
    requests["success"] = requests["success"].astype(bool)
    rate = point.workload["request_rate"]
    row: dict[str, Any] = {"point_id": point.point_id, "name": point.name, "series": point.series,
                           "folder": f"{POINTS_DIR}/{point.folder}", **point.axes}
    sim = SimConfig.from_flat(point.sim).flat()
    sim.pop("label")
    sim["num_gpu_blocks"] = config.get("num_gpu_blocks")  # as derived
    row.update({k: _cell(v) for k, v in {**sim, **point.workload}.items() if k not in row})
    row["request_rate"] = rate if rate is not None else config.get("trace_request_rate")
    row["num_requests_run"] = len(requests)
    row.update(summary_metrics(summary))
    if slo is not None:
        row.update(slo_metrics(requests, slo, float(summary["duration"])))
    row.update(tenant_ttft(requests))
    return row


def _cell(value: Any) -> Any:
    """A config value as a CSV cell (tables and lists as JSON, None as empty)."""
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value


def summary_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's scalars (null as NaN), and ``tenant_service_<tenant>`` per tenant."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            out.update({f"{key}_{k}": v for k, v in sorted(value.items())})
        else:
            out[key] = math.nan if value is None else value
    return out


def slo_metrics(requests: pd.DataFrame, slo: SloSpec, duration_s: float) -> dict[str, float]:
    """``slo_attainment``: the fraction of all requests that succeeded and met every SLO (an unknown
    value, e.g. the TPOT of a one-token reply, passes); ``request_goodput``: those per second."""
    good = requests["success"].copy()
    for key, limit in slo.slos_ms.items():
        col = requests[f"{key}_ms"]
        good &= col.isna() | (col <= limit)
    count = int(good.sum())
    return {"slo_attainment": count / len(requests) if len(requests) else math.nan,
            "request_goodput": count / max(duration_s, 1e-9)}


def tenant_ttft(requests: pd.DataFrame) -> dict[str, float]:
    """Per tenant (when there are two or more): mean and p90 TTFT of its successful requests."""
    ok = requests[requests["success"]]
    if ok["tenant"].nunique() < 2:
        return {}
    out = {}
    for tenant, group in ok.groupby("tenant", sort=True):
        ttft = group["ttft_ms"].dropna().to_numpy(dtype=float)
        out[f"tenant_{tenant}_mean_ttft_ms"] = float(ttft.mean()) if len(ttft) else math.nan
        out[f"tenant_{tenant}_p{TENANT_TTFT_PERCENTILE}_ttft_ms"] = (
            float(np.percentile(ttft, TENANT_TTFT_PERCENTILE)) if len(ttft) else math.nan)
    return out


# ---------------------------------------------------------------- capacity


def find_capacity(sweep: pd.DataFrame, target: float, group_cols: Sequence[str],
                  rate_col: str = "request_rate",
                  attainment_col: str = "slo_attainment") -> pd.DataFrame:
    """Per configuration (``group_cols``; all rows are one when empty): the capacity, see
    :func:`capacity_of`. Several rows at one rate (e.g. seeds) count by their mean attainment."""
    missing = [c for c in (*group_cols, rate_col, attainment_col) if c not in sweep.columns]
    if missing:
        raise ValueError(f"the sweep table lacks column(s) {', '.join(missing)}.")
    groups = sweep.groupby(list(group_cols), sort=False, dropna=False) if group_cols else [((), sweep)]
    rows = []
    for key, group in groups:
        curve = group.groupby(rate_col, sort=True)[attainment_col].mean()
        values = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(group_cols, values)),
                     **capacity_of(curve.index.to_list(), curve.to_list(), target)})
    return pd.DataFrame(rows, columns=[*group_cols, *CAPACITY_COLUMNS])


def capacity_of(rates: Sequence[float], attainments: Sequence[float], target: float) -> dict[str, Any]:
    """The capacity of one configuration, from its attainment at increasing ``rates``.

    ``max_rate_meeting_slo``: the highest rate whose attainment is >= ``target``; ``capacity_rps``:
    where the line from it to the next rate (which misses) crosses ``target``; if every rate meets
    the target, the highest rate (a lower bound); if none does, NaN.
    """
    passing = [i for i, a in enumerate(attainments) if a >= target]
    if not passing:
        return {"capacity_rps": math.nan, "max_rate_meeting_slo": math.nan,
                "attainment_at_capacity": math.nan, "status": "no rate meets the SLO target"}
    i = passing[-1]
    r0, a0 = float(rates[i]), float(attainments[i])
    if i == len(rates) - 1:
        return {"capacity_rps": r0, "max_rate_meeting_slo": r0, "attainment_at_capacity": a0,
                "status": "lower bound: the highest rate meets the target"}
    r1, a1 = float(rates[i + 1]), float(attainments[i + 1])
    if math.isnan(a1):
        crossing = r0
    else:
        crossing = r0 + (a0 - target) / (a0 - a1) * (r1 - r0)
    return {"capacity_rps": crossing, "max_rate_meeting_slo": r0, "attainment_at_capacity": a0,
            "status": "interpolated"}


# ---------------------------------------------------------------- the whole sweep


def run_sweep(spec: SweepSpec | str | Path, out_dir: str | Path, backend: str = "local",
              workers: int | None = None, address: str | None = None,
              progress: bool = True, report: bool = True) -> pd.DataFrame:
    """Runs every point not already complete in ``out_dir``, writes sweep.csv, capacity.csv (when
    the grid has request rates and the spec SLOs) and, with ``report``, report.html; returns the
    sweep table. ``progress``: show a progress bar over points and print the capacity table."""
    spec = spec if isinstance(spec, SweepSpec) else load_spec(spec)
    _check_run_args(backend, workers, address)
    out = Path(out_dir)
    points_dir = out / POINTS_DIR
    points_dir.mkdir(parents=True, exist_ok=True)
    (out / "sweep_spec.json").write_text(json.dumps(dataclasses.asdict(spec), indent=2) + "\n")
    points = spec.points()
    pending = [p for p in points if not is_complete(points_dir / p.folder, p.point_id)]
    t0 = time.perf_counter()
    with tqdm(total=len(points), initial=len(points) - len(pending), unit="point", desc="sweep",
              disable=not progress) as bar:
        execute(build_tasks(spec, pending, points_dir), backend, workers, address,
                lambda _: bar.update(1))
    wall = time.perf_counter() - t0
    sweep = pd.DataFrame([point_row(p, points_dir / p.folder, spec.slo) for p in points])
    sweep.attrs.update({"wall_time_s": wall, "points_run": len(pending), "points_total": len(points)})
    sweep.to_csv(out / "sweep.csv", index=False)
    capacity = _write_capacity(spec, sweep, out)
    if progress:
        print(summary_text(spec, sweep, capacity))
    if report:
        write_sweep_report(spec, sweep, capacity, out)
    return sweep


def _check_run_args(backend: str, workers: int | None, address: str | None) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}.")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or workers < 1):
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}.")
    if address is not None and backend != "ray":
        raise ValueError("address applies only to backend 'ray'.")


def _write_capacity(spec: SweepSpec, sweep: pd.DataFrame, out: Path) -> pd.DataFrame | None:
    if spec.slo is None or "request_rate" not in spec.grid:
        return None
    keys = ["series", *spec.series_keys]
    capacity = find_capacity(sweep, spec.slo.target, keys)
    capacity.to_csv(out / "capacity.csv", index=False)
    return capacity


def summary_text(spec: SweepSpec, sweep: pd.DataFrame, capacity: pd.DataFrame | None) -> str:
    """The compact printout: SLO attainment per configuration and rate, then the capacities."""
    lines = [f"{sweep.attrs.get('points_run', '?')} of {len(sweep)} points run in "
             f"{sweep.attrs.get('wall_time_s', math.nan):.1f} s"]
    if spec.slo is not None and "request_rate" in spec.grid:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in spec.slo.slos_ms.items())
        table = sweep.pivot_table(index="series", columns="request_rate", values="slo_attainment",
                                  sort=False)
        lines += [f"\nfraction of requests meeting {slos} (target {spec.slo.target:g}), "
                  f"by request rate (req/s):", table.to_string(float_format=lambda x: f"{x:.3f}")]
    if capacity is not None:
        shown = capacity[["series", "capacity_rps", "max_rate_meeting_slo", "status"]]
        lines += ["\ncapacity (req/s):",
                  shown.to_string(index=False, float_format=lambda x: f"{x:.2f}")]
    return "\n".join(lines)


def report_points(sweep: pd.DataFrame, capacity: pd.DataFrame | None) -> list[str]:
    """The run folders the report compares: all of a small sweep; else one per configuration, at
    its highest rate meeting the SLO (its lowest rate when none does, its first point without SLO)."""
    if len(sweep) <= REPORT_ALL_MAX:
        return sweep["folder"].to_list()
    chosen = []
    for series, group in sweep.groupby("series", sort=False):
        pick = group.iloc[0]
        if capacity is not None:
            rate = capacity.loc[capacity["series"] == series, "max_rate_meeting_slo"].iloc[0]
            at = group[group["request_rate"] == rate] if not math.isnan(rate) else group
            pick = at.sort_values("request_rate").iloc[0]
        chosen.append(pick["folder"])
    return chosen


def write_sweep_report(spec: SweepSpec, sweep: pd.DataFrame, capacity: pd.DataFrame | None,
                       out: Path) -> Path:
    from twinserve.reports import write_report  # plotly: kept out of the worker processes

    dirs = [out / folder for folder in report_points(sweep, capacity)]
    slos = spec.slo.slos_ms if spec.slo is not None else None
    return write_report(dirs, out / "report.html", slos_ms=slos, title=spec.title, sweep=sweep)


# ---------------------------------------------------------------- command line


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``twinserve sweep``."""
    parser.add_argument("spec", type=Path, help="sweep spec (TOML), e.g. examples/sweep_azure.toml")
    parser.add_argument("--backend", choices=BACKENDS, default="local",
                        help="local processes (default) or Ray tasks")
    parser.add_argument("--address", help="Ray cluster address (--backend ray; default: start a "
                        "local cluster). Its nodes must see --out (a shared file system)")
    parser.add_argument("--workers", type=int,
                        help="points run at once (default: the CPU count; local Ray cluster's CPUs)")
    parser.add_argument("--out", type=Path,
                        help="output folder (default: sweeps/<spec file stem>); rerunning resumes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or table")
    parser.add_argument("--no-report", action="store_true", help="skip report.html")


def run_sweep_cli(args: argparse.Namespace) -> int:
    """Runs ``twinserve sweep``; returns the exit status (2 for a bad spec or flag)."""
    out = args.out if args.out is not None else Path("sweeps") / args.spec.stem
    try:
        run_sweep(args.spec, out, backend=args.backend, workers=args.workers, address=args.address,
                  progress=not args.no_progress, report=not args.no_report)
    except ValueError as exc:
        print(f"twinserve sweep: error: {exc}", file=sys.stderr)
        return 2
    written = ["sweep.csv", *(["report.html"] if not args.no_report else [])]
    print(f"wrote {', '.join(str(out / name) for name in written)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twinserve sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(parser)
    return run_sweep_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
