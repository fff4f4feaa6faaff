"""A sweep: simulate every point of a grid (``sweep_spec``), collect the table, find capacities.

    OUT/
      sweep_spec.json        the validated spec
      points/<name>-<id>/    one run folder per grid point (``core.run_dir``); id = hash of its config
      sweep.csv              one row per point (``sweep_table``): config, summary metrics, SLO attainment
      capacity.csv           per configuration: the highest request rate meeting the SLO target
                             (``capacity``)

Points run in parallel, in local processes (default) or as Ray tasks. A point whose folder already
holds a complete run of the same config is not rerun, so an interrupted or extended sweep resumes:
each point is written to a temporary folder and renamed into place when complete.

``ray`` is imported inside the function that uses it (an optional dependency); worker processes,
which import this module to run points, load no report code.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from twinserve.core.engine_args import EngineArgs
from twinserve.simulator.capacity import find_capacity
from twinserve.simulator.run import SimConfig, simulate, write_sim_run
from twinserve.simulator.sweep_spec import (
    SweepPoint,
    SweepSpec,
    base_trace,
    load_spec,
    mean_rate,
    point_adapters,
    point_trace,
)
from twinserve.simulator.sweep_table import point_row
from twinserve.traces import LoRAAdapters, TraceRequest

BACKENDS = ("local", "ray")
POINTS_DIR = "points"


@dataclass(frozen=True, slots=True)
class PointTask:
    """What a worker needs to run one point (picklable: plain data and the point's requests)."""

    point_id: str
    folder: str
    sim: dict[str, Any]
    label: str
    trace: list[TraceRequest]
    trace_desc: dict[str, Any]
    adapters: LoRAAdapters | None = None  # the shapes of the LoRA adapters the requests name


@dataclass(frozen=True, slots=True)
class PointDone:
    point_id: str
    wall_time_s: float


# ---------------------------------------------------------------- one point


def run_point(task: PointTask) -> PointDone:
    """Simulates one point and writes its run folder atomically (temporary folder, then rename)."""
    result = simulate(SimConfig.from_flat({**task.sim, "label": task.label}), task.trace,
                      adapters=task.adapters)
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
        adapters = point_adapters(point.workload, point.sim_config().engine)
        tasks.append(PointTask(point.point_id, str(points_dir / point.folder), point.sim, point.name,
                               trace, _trace_desc(point, trace), adapters))
    return tasks


def _trace_desc(point: SweepPoint, trace: list[TraceRequest]) -> dict[str, Any]:
    """What the run folder's config records besides the SimConfig fields."""
    policy = point.sim.get("scheduling_policy", EngineArgs().scheduling_policy)
    return {**point.workload, "policy": policy,
            "trace_request_rate": mean_rate(trace), "num_requests_run": len(trace),
            "sweep_point_id": point.point_id, "sweep_point_name": point.name,
            "sweep_series": point.series}


# ---------------------------------------------------------------- running many


def execute(tasks: list[Any], backend: str, workers: int | None, address: str | None,
            on_done: Callable[[Any], None], run: Callable[[Any], Any] = run_point) -> None:
    """Runs ``run(task)`` for each task on the backend, calling ``on_done`` with each result as
    it finishes. ``run`` (a module-level function, for the worker processes to import) and the
    tasks (picklable, with a ``folder`` named on errors) default to the sweep's points; the
    planner passes its own."""
    if not tasks:
        return
    if backend == "ray":
        _run_ray(tasks, address, workers, on_done, run)
    else:
        _run_local(tasks, workers or os.cpu_count() or 1, on_done, run)


def _run_local(tasks: list[Any], workers: int, on_done: Callable[[Any], None],
               run: Callable[[Any], Any]) -> None:
    if workers == 1 or len(tasks) == 1:
        for task in tasks:
            on_done(_named(task, partial(run, task)))
        return
    # spawn, not fork: the parent may hold threads (tqdm's monitor, a Ray driver).
    pool = ProcessPoolExecutor(max_workers=min(workers, len(tasks)),
                               mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {pool.submit(run, task): task for task in tasks}
        for future in as_completed(futures):
            on_done(_named(futures[future], future.result))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _run_ray(tasks: list[Any], address: str | None, workers: int | None,
             on_done: Callable[[Any], None], run: Callable[[Any], Any]) -> None:
    import ray  # optional dependency: pip install twinserve[ray]

    started = not ray.is_initialized()
    if started:
        ray.init(address=address or "local", num_cpus=workers if address is None else None,
                 include_dashboard=False, configure_logging=False)
    pending: dict[Any, PointTask] = {}
    try:
        remote = ray.remote(num_cpus=1)(run)
        pending.update({remote.remote(task): task for task in tasks})
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            task = pending.pop(done[0])
            on_done(_named(task, partial(_ray_result, done[0])))
    finally:
        for ref in pending:
            ray.cancel(ref)
        if started:
            ray.shutdown()


def _ray_result(ref: Any) -> Any:
    import ray

    return ray.get(ref)


def _named(task: Any, result: Callable[[], Any]) -> Any:
    """``result()``, with the folder of the point it belongs to noted on any error."""
    try:
        return result()
    except Exception as exc:
        exc.add_note(f"while running sweep point {task.folder}")
        raise


# ---------------------------------------------------------------- the whole sweep


def run_sweep(spec: SweepSpec | str | Path, out_dir: str | Path, backend: str = "local",
              workers: int | None = None, address: str | None = None,
              progress: bool = True) -> pd.DataFrame:
    """Runs every point not already complete in ``out_dir``, writes sweep.csv and capacity.csv
    (when the grid has request rates and the spec SLOs); returns the sweep table (its ``attrs``:
    ``wall_time_s``, ``points_run``, ``points_total``). ``progress``: a progress bar over points."""
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
    sweep = pd.DataFrame([point_row(p, points_dir / p.folder, spec.slo, f"{POINTS_DIR}/{p.folder}")
                          for p in points])
    sweep.attrs.update({"wall_time_s": wall, "points_run": len(pending), "points_total": len(points)})
    sweep.to_csv(out / "sweep.csv", index=False)
    capacity = sweep_capacity(spec, sweep)
    if capacity is not None:
        capacity.to_csv(out / "capacity.csv", index=False)
    return sweep


def _check_run_args(backend: str, workers: int | None, address: str | None) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}.")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or workers < 1):
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}.")
    if address is not None and backend != "ray":
        raise ValueError("address applies only to backend 'ray'.")


def sweep_capacity(spec: SweepSpec, sweep: pd.DataFrame) -> pd.DataFrame | None:
    """The capacity of each configuration (``series`` and the axes but the rate), or ``None``
    when the grid has no request rates or the spec no SLOs."""
    if spec.slo is None or "request_rate" not in spec.grid:
        return None
    return find_capacity(sweep, spec.slo.target, ["series", *spec.series_keys])
