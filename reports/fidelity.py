"""How far the twin lands from the real engine: the error table of ``twinserve validate``.

One row per metric: the median of the real runs' values (``real``, with their spread
``real_min``..``real_max`` over ``real_runs`` runs), the twin's (``sim``), the signed relative error
``100 * (sim - real) / real`` and, where the metric has one, its target and whether it is met.
``OUT/errors.csv`` holds the rows (``ERROR_COLUMNS``).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# metric, target |relative error| in % (None: reported, no target)
TARGETS: tuple[tuple[str, float | None], ...] = (
    ("request_throughput", 5.0), ("output_throughput", 5.0), ("mean_ttft_ms", 10.0),
    ("p90_ttft_ms", None), ("mean_tpot_ms", 10.0), ("mean_e2el_ms", 5.0),
    ("median_e2el_ms", None), ("p90_e2el_ms", 10.0), ("num_preemptions", None),
    ("prefix_cache_hit_rate", None),
)
STEP_TIME_METRIC = "replayed_step_time_s"  # the real steps, measured vs as the profile times them
ERROR_COLUMNS = ("metric", "real", "sim", "rel_error_pct", "target_pct", "within_target",
                 "real_min", "real_max", "real_runs")


def error_rows(reals: Sequence[dict[str, Any]], sim: dict[str, Any]) -> list[dict[str, Any]]:
    """The twin's signed relative error per metric against the median of the real runs."""
    if not reals:
        raise ValueError("error_rows needs at least one real run summary.")
    return [error_row(metric, [as_number(r.get(metric)) for r in reals], as_number(sim.get(metric)), target)
            for metric, target in TARGETS]


def error_row(metric: str, reals: Sequence[float], sim: float,
              target: float | None = None) -> dict[str, Any]:
    """One metric: the median of the real values against the twin's."""
    values = [v for v in reals if not math.isnan(v)]
    r = float(np.median(values)) if values else math.nan
    if math.isnan(r) or math.isnan(sim):
        err = math.nan
    elif r == 0:
        err = 0.0 if sim == 0 else math.nan
    else:
        err = 100.0 * (sim - r) / r
    within = "" if target is None or math.isnan(err) else str(abs(err) <= target).lower()
    return {"metric": metric, "real": r, "sim": sim, "rel_error_pct": err,
            "target_pct": "" if target is None else target, "within_target": within,
            "real_min": min(values, default=math.nan), "real_max": max(values, default=math.nan),
            "real_runs": len(values)}


def step_time_row(measured_s: float, predicted_s: float, real_runs: int) -> dict[str, Any]:
    """The real runs' own steps timed by the profile: their measured total seconds (``real``)
    against the cost model's total for the very same steps (``sim``; ``real_runs`` 0 when no run
    recorded its steps). It separates the step-time model's error (or the machine's drift since
    calibration) from the scheduling dynamics."""
    recorded = real_runs > 0
    err = 100.0 * (predicted_s - measured_s) / measured_s if measured_s > 0 else math.nan
    return {"metric": STEP_TIME_METRIC, "real": measured_s if recorded else math.nan,
            "sim": predicted_s if recorded else math.nan, "rel_error_pct": err, "target_pct": "",
            "within_target": "", "real_min": math.nan, "real_max": math.nan,
            "real_runs": real_runs}


def tenant_ttft_rows(real_dirs: Sequence[Path], sim_dir: Path) -> list[dict[str, Any]]:
    """``mean_ttft_ms[<tenant>]`` per tenant when the workload has several: what a fairness
    policy moves while the overall means barely change."""
    reals = [_tenant_mean_ttft(d / "requests.csv") for d in real_dirs]
    sim = _tenant_mean_ttft(sim_dir / "requests.csv")
    if len(sim) < 2:
        return []
    return [error_row(f"mean_ttft_ms[{t}]", [r.get(t, math.nan) for r in reals], sim[t])
            for t in sorted(sim)]


def _tenant_mean_ttft(path: Path) -> dict[str, float]:
    by_tenant: dict[str, list[float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["success"] == "1":
                by_tenant.setdefault(row["tenant"], []).append(float(row["ttft_ms"]))
    return {t: float(np.mean(v)) for t, v in by_tenant.items()}


def as_number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def write_errors(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, ERROR_COLUMNS, lineterminator="\n")
        w.writeheader()
        for row in rows:
            w.writerow({k: (repr(round(v, 6)) if isinstance(v, float) and not math.isnan(v) else
                            ("" if isinstance(v, float) else v)) for k, v in row.items()})
    return path


def format_errors(rows: Sequence[dict[str, Any]], title: str = "sim vs real") -> str:
    spread = any(row.get("real_runs", 1) > 1 for row in rows)
    lines = [title, f"  {'metric':<24} {'real':>12} {'sim':>12} {'error %':>9} {'target':>7}"
             + ("   real min..max" if spread else "")]
    for row in rows:
        target = f"±{row['target_pct']:g}" if row["target_pct"] != "" else ""
        target_pct = None if row["target_pct"] == "" else float(row["target_pct"])
        mark = verdict(row["rel_error_pct"], target_pct,
                       spread_pct(row) if row.get("real_runs", 0) > 1 else math.nan)
        mark = f" {mark}" if mark else ""
        line = (f"  {row['metric']:<24} {row['real']:>12.4g} {row['sim']:>12.4g} "
                f"{row['rel_error_pct']:>+9.2f} {target:>7}{mark:<5}")
        if spread and row.get("real_runs", 0) > 1:
            line += f" {row['real_min']:.4g}..{row['real_max']:.4g}"
        lines.append(line.rstrip())
    if spread:
        judged = [row for row in rows if row["target_pct"] != "" and row.get("real_runs", 0) > 1]
        lines.append("  " + host_check([(spread_pct(row), float(row["target_pct"]))
                                        for row in judged]))
    return "\n".join(lines)


def verdict(error_pct: float, target_pct: float | None, spread: float) -> str:
    """``ok`` within the target, ``~`` within the real runs' larger spread (``spread_pct``),
    ``MISS`` outside both, ``""`` without a target."""
    if target_pct is None or math.isnan(error_pct):
        return ""
    if abs(error_pct) <= target_pct:
        return "ok"
    return "~" if abs(error_pct) <= spread else "MISS"


def spread_pct(row: dict[str, Any]) -> float:
    """The real runs' spread of an error row: half of ``real_max - real_min`` over the real
    median, in % (nan without them)."""
    try:
        real, low, high = float(row["real"]), float(row["real_min"]), float(row["real_max"])
    except (KeyError, ValueError):
        return math.nan
    return half_range_pct(low, high, real)


def half_range_pct(low: float, high: float, middle: float) -> float:
    """Half of ``high - low`` over ``|middle|``, in % (0 or inf about a zero middle)."""
    if middle == 0:
        return 0.0 if high == low else math.inf
    return 100.0 * (high - low) / 2 / abs(middle)


def host_check(spreads_and_targets: Sequence[tuple[float, float]]) -> str:
    """Whether the real runs could resolve the targets: how many targeted metrics' runs spread
    wider than the target itself (the host moved more between them than the twin may err), and
    the median of those spreads."""
    wide = sorted(s for s, target in spreads_and_targets if s > target)
    if not wide:
        return "host: no targeted metric's replays spread wider than its target"
    return (f"host: {len(wide)}/{len(spreads_and_targets)} targeted metrics' replays spread "
            f"wider than their target (median {wide[len(wide) // 2]:.1f}%): there the host, not "
            f"the twin, sets the verdict; rerun on a quieter host")
