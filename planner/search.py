"""Each configuration's capacity: the highest request rate whose replay meets the SLOs, found by a
bracketing search over a geometric grid of rates.

Rates are ``base_rps * (1 + tolerance) ** k`` for integer ``k``, so two neighbouring rates differ by
the relative tolerance and every search (and an exhaustive sweep of the same grid) lands on the
same values. From a starting index the search steps by a doubling of the rate while the verdict
holds (or halving while it fails) until it brackets the boundary, then bisects the indices until
the passing and failing rates are neighbours::

    k:   s        s+g      s+2g          (pass, pass, fail: bracket [s+g, s+2g])
         pass     pass     fail
                  lo ----- mid ----- hi   bisect until hi - lo == 1; capacity = rate(lo)

It assumes attainment falls as the rate rises (what capacity means); where a replay is not
monotone the answer is one boundary, as Vidur-Search's binary search gives.

One configuration's search runs in one worker (``search_candidate``, sequential: each replay
decides the next rate); each replay is a point folder's ``r<k>.json``, written atomically, so an
interrupted plan resumes without replaying a finished point.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinserve.planner.slo import FAIL, PASS, Slo, VerdictTracker
from twinserve.simulator.acceptance import AcceptanceProfile
from twinserve.simulator.run import SimConfig, simulate
from twinserve.simulator.sweep_spec import mean_rate
from twinserve.traces import TraceRequest, scale_time

POINT_VERSION = 2  # part of every point file: bump when a point's meaning changes
SUMMARY_KEYS = ("request_throughput", "output_throughput", "mean_ttft_ms", "p90_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "p90_e2el_ms")


@dataclass(frozen=True, slots=True)
class RateGrid:
    """The rates a search may visit: ``base_rps * (1 + tolerance) ** k``, within [min, max]."""

    base_rps: float = 1.0
    tolerance: float = 0.05
    min_rps: float = 0.05
    max_rps: float = 1000.0

    def __post_init__(self) -> None:
        for name in ("base_rps", "min_rps", "max_rps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a rate > 0 (req/s), got {value!r}.")
        if not 0 < self.tolerance <= 1:
            raise ValueError(f"tolerance: expected a relative step in (0, 1], got {self.tolerance!r}.")
        if not self.min_rps <= self.base_rps <= self.max_rps:
            raise ValueError("base_rps must lie between min_rps and max_rps.")

    def rate(self, k: int) -> float:
        return self.base_rps * (1.0 + self.tolerance) ** k

    def index_near(self, rate: float) -> int:
        k = round(math.log(rate / self.base_rps) / math.log1p(self.tolerance))
        return min(max(k, self.lowest), self.highest)

    @property
    def lowest(self) -> int:
        return math.ceil(math.log(self.min_rps / self.base_rps) / math.log1p(self.tolerance) - 1e-9)

    @property
    def highest(self) -> int:
        return math.floor(math.log(self.max_rps / self.base_rps) / math.log1p(self.tolerance) + 1e-9)

    @property
    def step(self) -> int:
        """Indices per doubling of the rate (the bracketing phase's stride)."""
        return max(1, round(math.log(2.0) / math.log1p(self.tolerance)))


def bracket(passes: Callable[[int], bool], grid: RateGrid, start: int = 0) -> int | None:
    """The highest index whose rate passes, by the bracketing search above (``None``: not even
    the lowest rate passes). ``passes`` is asked at most once per index."""
    lo, hi = _bracket_ends(passes, grid, min(max(start, grid.lowest), grid.highest))
    if lo is None:
        return None
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _bracket_ends(passes: Callable[[int], bool], grid: RateGrid,
                  k: int) -> tuple[int | None, int | None]:
    """(highest known pass, lowest known fail above it); a missing end is ``None``."""
    if passes(k):
        while k < grid.highest:
            nxt = min(k + grid.step, grid.highest)
            if not passes(nxt):
                return k, nxt
            k = nxt
        return k, None
    while k > grid.lowest:
        nxt = max(k - grid.step, grid.lowest)
        if passes(nxt):
            return nxt, k
        k = nxt
    return None, k


# ---------------------------------------------------------------- one configuration, in a worker


@dataclass(frozen=True, slots=True)
class SearchTask:
    """What a worker needs to search one configuration (picklable)."""

    folder: str  # the configuration's point folder: one r<k>.json per replay
    candidate_id: str
    sim: dict[str, Any]
    trace: list[TraceRequest]
    slos: tuple[Slo, ...]
    grid: RateGrid
    start: int = 0
    early_stop: bool = True
    acceptance: AcceptanceProfile | None = None
    duration_s: float | None = None  # each replay spans this much of arrivals (None: the whole trace)


@dataclass(frozen=True, slots=True)
class SearchOutcome:
    candidate_id: str
    capacity_index: int | None  # None: no rate of the grid meets the SLOs
    capacity_rps: float
    at_capacity: dict[str, Any]  # the passing replay at capacity: its summary and attainment
    points: dict[int, str]  # index -> verdict of every replay the search needed
    replays_run: int  # replayed now (the rest were read back from the folder)
    stopped_early: int  # of those, how many ended once their verdict was decided
    wall_time_s: float


def search_candidate(task: SearchTask) -> SearchOutcome:
    """The bracketing search of one configuration, resuming from its point folder."""
    t0 = time.perf_counter()
    folder = Path(task.folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = SimConfig.from_flat(task.sim)
    points: dict[int, dict[str, Any]] = {}
    counts = {"run": 0, "early": 0}

    def passes(k: int) -> bool:
        point = _read_point(folder / f"r{k}.json", task)
        if point is None:
            point = replay_point(cfg, task, k)
            _write_point(folder / f"r{k}.json", point)
            counts["run"] += 1
            counts["early"] += point["stopped_early"]
        points[k] = point
        return point["verdict"] == PASS

    best = bracket(passes, task.grid, task.start)
    return SearchOutcome(
        task.candidate_id, best, task.grid.rate(best) if best is not None else math.nan,
        points[best] if best is not None else {}, {k: p["verdict"] for k, p in points.items()},
        counts["run"], counts["early"], time.perf_counter() - t0)


def replay_requests(trace: list[TraceRequest], rate: float,
                    duration_s: float | None) -> list[TraceRequest]:
    """The requests of one replay at ``rate``: the trace's first ``rate * duration_s`` requests
    (all of them without a duration, or when it has fewer), time-scaled to that mean rate. A
    fixed duration keeps a high rate from passing only because its replay ends before queues
    build (a short trace at a high rate is one burst)."""
    n = len(trace) if duration_s is None else min(len(trace), max(2, math.ceil(rate * duration_s) + 1))
    head = trace[:n]
    native = mean_rate(head)
    if not math.isfinite(native):
        raise ValueError("trace: its first requests span no time, so they cannot be scaled to a rate.")
    return scale_time(head, rate / native)


def replay_point(cfg: SimConfig, task: SearchTask, k: int) -> dict[str, Any]:
    """One replay at rate index ``k``, stopped once it is known to fail (a passing replay runs
    to its end: its figures are the configuration's at capacity)."""
    rate = task.grid.rate(k)
    trace = replay_requests(task.trace, rate, task.duration_s)
    watch = VerdictTracker(task.slos, len(trace), stop_on=(FAIL,) if task.early_stop else ())
    result = simulate(cfg, trace, acceptance=task.acceptance,
                      stop_when=watch.update if task.early_stop else None)
    # The verdict counts the records the result holds, in a fresh tracker: ``watch`` read the
    # recorder's list as it grew, and a refused request joins it outside the finish callback
    # (then the result's sorted records are not that list's order).
    tracker = VerdictTracker(task.slos, len(trace))
    tracker.update(result.records)
    verdict = tracker.final()
    summary = {key: result.summary.get(key) for key in SUMMARY_KEYS} if verdict == PASS else {}
    return {"version": POINT_VERSION, "candidate_id": task.candidate_id, "k": k, "rate_rps": rate,
            "num_requests": len(trace), "span_s": trace[-1].arrival_time - trace[0].arrival_time,
            "mean_output_tokens": sum(r.output_tokens for r in trace) / len(trace),
            "verdict": verdict, "attainment": tracker.attainment(),
            "finished": len(result.records), "stopped_early": len(result.records) < len(trace),
            "summary": summary, "wall_time_s": result.wall_time_s}


def _read_point(path: Path, task: SearchTask) -> dict[str, Any] | None:
    """A finished replay of this configuration at this rate (None: absent, torn or other)."""
    try:
        point = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    same = (point.get("version") == POINT_VERSION and point.get("candidate_id") == task.candidate_id
            and point.get("k") == int(path.stem[1:]))
    return point if same else None


def _write_point(path: Path, point: dict[str, Any]) -> None:
    """Written to a temporary file and renamed into place: a point file is whole or absent."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(point, f, indent=1, default=str)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
