"""The whole search: enumerate the space, prune what cannot fit, search the rest in waves of
growing GPU count (so the dominance bound has smaller configurations to stand on), rank.

    OUT/
      points/<config>-<id>/r<k>.json   one replay per configuration and rate index (resumable)
      plan.csv, front.csv, best.yaml, plan.html   (``output``, ``report``)

A wave's configurations run in parallel on the sweep's executor (local processes or Ray), one
configuration's bracketing search per task.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from twinserve.planner.pareto import Searched, capacity_bound, is_dominated
from twinserve.planner.search import RateGrid, SearchOutcome, SearchTask, search_candidate
from twinserve.planner.space import Candidate, size_candidate
from twinserve.planner.spec import MULTI_APP, MULTI_APP_REQUESTS, PlanSpec
from twinserve.simulator.acceptance import AcceptanceProfile
from twinserve.simulator.acceptance_merge import load_profiles
from twinserve.simulator.sweep import POINTS_DIR, execute
from twinserve.simulator.sweep import _check_run_args as check_run_args
from twinserve.traces import TraceRequest, load_trace
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace

FITTED, PRUNED, DOMINATED, NO_CAPACITY = "fitted", "pruned-memory", "dominated", "no-capacity"


@dataclass(slots=True)
class PlanResult:
    rows: list[dict[str, Any]]  # one per configuration, ranked: fitted by cost per output token
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> dict[str, Any] | None:
        return next((r for r in self.rows if r["status"] == FITTED), None)

    def fitted(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == FITTED]


def plan_trace(spec: PlanSpec) -> list[TraceRequest]:
    """The plan's requests: the trace's first ``num_requests``, or the multi-application
    workload generated from its settings (``MULTI_APP_REQUESTS`` of them by default)."""
    if spec.trace == MULTI_APP:
        return multi_app_trace(MultiAppConfig(num_requests=spec.num_requests or MULTI_APP_REQUESTS,
                                              **dict(spec.trace_options)))
    return load_trace(spec.trace, limit=spec.num_requests)


def run_plan(spec: PlanSpec, out_dir: str | Path, backend: str = "local", workers: int | None = None,
             address: str | None = None, resume: bool = False,
             log: Callable[[str], None] | None = None) -> PlanResult:
    """Searches the plan's space into ``out_dir``; ``resume``: reuse the replays a previous run
    of the same plan left there (without it, a folder already holding replays is refused)."""
    check_run_args(backend, workers, address)
    t0 = time.perf_counter()
    log = log or (lambda msg: None)
    out = Path(out_dir)
    points_dir = out / POINTS_DIR
    if not resume and points_dir.is_dir() and any(points_dir.iterdir()):
        raise ValueError(f"out: {out} already holds a plan's replays; pass --resume to continue it "
                         "or name another folder.")
    points_dir.mkdir(parents=True, exist_ok=True)
    trace = plan_trace(spec)
    longest = max(r.input_tokens + r.output_tokens for r in trace)
    longest_prompt = max(r.input_tokens for r in trace)
    acceptance = (load_profiles(spec.acceptance_profile)
                  if spec.acceptance_profile else None)
    fingerprint = _fingerprint(spec, len(trace))
    grid = rate_grid(spec, len(trace))
    rows: dict[str, dict[str, Any]] = {}
    live: dict[str, tuple[Candidate, tuple[Any, ...]]] = {}  # id -> candidate, dominance key
    for cand in spec.space.candidates():
        sizing = size_candidate(cand, spec.space.model, spec.space.fixed, longest, longest_prompt)
        rows[cand.candidate_id] = _row(cand, spec, PRUNED if sizing.reason else "", sizing.reason)
        if not sizing.reason:  # the bound compares step times of one kind (a fit, a roofline)
            live[cand.candidate_id] = (cand, (*cand.replica_key, sizing.cost_basis))
    log(f"{len(rows)} configurations, {len(rows) - len(live)} pruned by memory")
    searched: list[Searched] = []  # their capacity in req/s (where a search starts)
    sustained: list[Searched] = []  # in output tokens/s (the dominance bound)
    totals = {"replays_run": 0, "replays_reused": 0, "stopped_early": 0}
    for gpus in sorted({c.gpus for c, _ in live.values()}):
        wave = [(c, key) for c, key in live.values() if c.gpus == gpus]
        tasks = _wave_tasks(wave, spec, grid, (searched, sustained), rows, points_dir, trace,
                            fingerprint, acceptance)
        log(f"{gpus} GPU(s): searching {len(tasks)} of {len(wave)} configurations")
        outcomes: list[SearchOutcome] = []
        execute(tasks, backend, workers, address, outcomes.append, run=search_candidate)
        for outcome in outcomes:
            cid = outcome.candidate_id.split(":")[1]
            _fill(rows[cid], outcome, grid)
            key, row = live[cid][1], rows[cid]
            searched.append(Searched(key, row["gpus"], row["capacity_rps"]))
            sustained.append(Searched(key, row["gpus"], row["output_tokens_per_s"]))
            totals["replays_run"] += outcome.replays_run
            totals["replays_reused"] += len(outcome.points) - outcome.replays_run
            totals["stopped_early"] += outcome.stopped_early
    ranked = sorted(rows.values(), key=_rank)
    stats = {"configurations": len(rows), **_count(ranked), **totals,
             "wall_time_s": time.perf_counter() - t0, "requests_per_replay": len(trace)}
    return PlanResult(ranked, stats)


def rate_grid(spec: PlanSpec, num_requests: int) -> RateGrid:
    """The spec's grid, its highest rate lowered so that a replay of ``duration_s`` never runs
    out of the trace's requests (a shorter replay at a high rate is one burst, see
    ``search.replay_requests``)."""
    if spec.duration_s is None:
        return spec.grid
    most = (num_requests - 1) / spec.duration_s
    if most >= spec.grid.max_rps:
        return spec.grid
    if most < spec.grid.base_rps:
        raise ValueError(f"workload: {num_requests} requests over duration_s {spec.duration_s:g} s "
                         f"reach only {most:.3g} req/s, below search.base_rps "
                         f"{spec.grid.base_rps:g}: take more requests or a shorter duration.")
    return replace(spec.grid, max_rps=most)


def _wave_tasks(wave: list[tuple[Candidate, tuple[Any, ...]]], spec: PlanSpec, grid: RateGrid,
                searched: tuple[list[Searched], list[Searched]], rows: dict[str, dict[str, Any]],
                points_dir: Path,
                trace: list[TraceRequest], fingerprint: str,
                acceptance: AcceptanceProfile | None) -> list[SearchTask]:
    by_rate, by_tokens = searched
    best = max((r["output_tokens_per_s"] / (r["gpus"] * r["price_per_gpu_hour"])
                for r in rows.values() if r["status"] == FITTED), default=math.nan)
    tasks = []
    for cand, key in wave:
        price = spec.price(cand.hardware)
        bound = capacity_bound(key, cand.gpus, by_tokens, spec.dominance_slack)
        if bound is not None and is_dominated(bound, cand.gpus, price, best):
            rows[cand.candidate_id].update(status=DOMINATED, bound_tokens_per_s=bound, reason=(
                f"output <= {bound:.4g} tok/s (bound), so <= {bound / (cand.gpus * price):.4g} "
                f"tok/s per $/h, below the best found ({best:.4g})"))
            continue
        # the search starts where linear scaling from the smaller siblings puts it
        estimate = capacity_bound(key, cand.gpus, by_rate, 1.0)
        start = grid.index_near(estimate) if estimate else 0
        tasks.append(SearchTask(str(points_dir / cand.folder), f"{fingerprint}:{cand.candidate_id}",
                                cand.sim(spec.space.model, spec.space.fixed), trace, spec.slos,
                                grid, start, spec.early_stop,
                                None if cand.disaggregated else acceptance, spec.duration_s))
    return tasks


def _row(cand: Candidate, spec: PlanSpec, status: str, reason: str) -> dict[str, Any]:
    settings = {k: (json.dumps(v, sort_keys=True) if isinstance(v, dict) else v)
                for k, v in cand.settings.items()}
    return {"candidate_id": cand.candidate_id, "name": cand.name, **settings, "gpus": cand.gpus,
            "price_per_gpu_hour": spec.price(cand.hardware), "status": status,
            "capacity_rps": math.nan, "capacity_per_dollar_hour": math.nan,
            "output_tokens_per_s": math.nan, "output_tokens_per_s_per_gpu": math.nan,
            "output_tokens_per_s_per_user": math.nan, "p90_ttft_ms": math.nan,
            "p99_tpot_ms": math.nan, "cost_per_m_output_tokens": math.nan,
            "bound_tokens_per_s": math.nan, "replays": 0, "capacity_lower_bound": False,
            "reason": reason,
            "folder": f"{POINTS_DIR}/{cand.folder}"}


def _fill(row: dict[str, Any], outcome: SearchOutcome, grid: RateGrid) -> None:
    """The row of a searched configuration, from its replay at capacity."""
    row["replays"] = len(outcome.points)
    if outcome.capacity_index is None:
        row.update(status=NO_CAPACITY, reason=f"fails the SLOs even at {grid.min_rps:g} req/s")
        return
    point = outcome.at_capacity
    summary = point["summary"]
    gpus, price = row["gpus"], row["price_per_gpu_hour"]
    # sustained output: the capacity times the tokens a request asks for (the replay's own
    # output_throughput divides by its whole length, the drain after the last arrival included)
    tokens = outcome.capacity_rps * float(point["mean_output_tokens"])
    tpot = summary.get("mean_tpot_ms")
    censored = outcome.capacity_index >= grid.highest  # (it passed where the search ends)
    row.update(status=FITTED, capacity_rps=outcome.capacity_rps, capacity_lower_bound=censored,
               capacity_per_dollar_hour=outcome.capacity_rps / (gpus * price),
               output_tokens_per_s=tokens, output_tokens_per_s_per_gpu=tokens / gpus,
               output_tokens_per_s_per_user=1000.0 / tpot if tpot else math.nan,
               p90_ttft_ms=summary.get("p90_ttft_ms"), p99_tpot_ms=summary.get("p99_tpot_ms"),
               cost_per_m_output_tokens=gpus * price / (tokens * 3600.0) * 1e6 if tokens
               else math.nan, reason="" if not censored else
               f"lower bound: passes at the grid's highest rate {grid.rate(grid.highest):.4g} "
               "req/s (search.max_rps, or the most the trace holds over duration_s)")


def _rank(row: dict[str, Any]) -> tuple[Any, ...]:
    """Fitted first, by cost per million output tokens (then fewer GPUs), then the others."""
    order = {FITTED: 0, NO_CAPACITY: 1, DOMINATED: 2, PRUNED: 3}[row["status"]]
    cost = row["cost_per_m_output_tokens"]
    return (order, cost if cost == cost else math.inf, row["gpus"], row["name"])


def _count(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {status.replace("-", "_"): sum(r["status"] == status for r in rows)
            for status in (FITTED, PRUNED, DOMINATED, NO_CAPACITY)}


def _fingerprint(spec: PlanSpec, num_requests: int) -> str:
    """What a replay's verdict depends on besides its configuration and rate."""
    blob = json.dumps({"model": spec.space.model, "fixed": spec.space.fixed,
                       "slos": [asdict(s) for s in spec.slos], "trace": spec.trace,
                       **({"trace_options": dict(spec.trace_options)} if spec.trace_options
                          else {}),  # (a loaded trace's fingerprint as before)
                       "num_requests": num_requests, "duration_s": spec.duration_s,
                       "grid": asdict(rate_grid(spec, num_requests)),
                       "acceptance": spec.acceptance_profile}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
