"""The fidelity study's table: per workload and metric, the twin against the replays' median,
the replays' spread, the verdict, and the same at the replays' own speed (``fidelity.study``)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from twinserve.fidelity.speeds import HOST_SPEED_METRIC, REPLAY_SPEED_METRIC
from twinserve.reports.fidelity import TARGETS, host_check, spread_pct, verdict
from twinserve.reports.repeatability import Repeatability, read_repeatability

TABLE_METRICS = ("request_throughput", "mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms",
                 "p90_e2el_ms")
_TARGET = dict(TARGETS)


def study_rows(workload: str, errors_csv: Path, real_dirs: list[Path],
               at_replay_csv: Path | None = None) -> list[dict[str, object]]:
    """The table metrics of one workload: real median, twin, error, target, spread, verdict;
    with ``at_replay_csv`` (``validate --at-replay-speed``'s errors) also the twin's error and
    verdict at the replays' own speed."""
    errors = _read_errors(errors_csv)
    at_replay = _read_errors(at_replay_csv) if at_replay_csv is not None else {}
    repeats = read_repeatability(errors_csv.with_name("repeatability.csv"))
    repeats_at_replay = (read_repeatability(at_replay_csv.with_name("repeatability.csv"))
                         if at_replay_csv is not None else {})
    rows: list[dict[str, object]] = []
    tenants = [m for m in errors if m.startswith("mean_ttft_ms[")]  # fair: per tenant
    for metric in (*TABLE_METRICS, *tenants, "num_preemptions", "prefix_cache_hit_rate",
                   "replayed_step_time_s", REPLAY_SPEED_METRIC, HOST_SPEED_METRIC):
        row = errors.get(metric)
        if row is None:
            continue
        err, spread, target = _error(row), spread_pct(row), _TARGET.get(metric)
        at_err = _error(at_replay[metric]) if metric in at_replay else math.nan
        rows.append({"workload": workload, "metric": metric, "real": float(row["real"]),
                     "sim": float(row["sim"]) if row["sim"] else math.nan, "error_pct": err,
                     "target_pct": "" if target is None else target, "spread_pct": spread,
                     "verdict": verdict(err, target, spread), "real_runs": len(real_dirs),
                     "error_at_replay_speed_pct": at_err,
                     "verdict_at_replay_speed": verdict(at_err, target, spread),
                     **_repeat_columns(repeats.get(metric), repeats_at_replay.get(metric))})
    return rows


def _repeat_columns(repeats: Repeatability | None,
                    at_replay: Repeatability | None) -> dict[str, object]:
    """A targeted metric's leave-one-out counts (``reports.repeatability``): of its
    ``repeat_refs`` references (each replay left out in turn), how many that replay passed
    against the others, how many the twin did, and the twin at the replays' speed."""
    return {"repeat_refs": repeats.runs if repeats else "",
            "replay_passes": repeats.replay_passes if repeats else "",
            "twin_passes": repeats.twin_passes if repeats else "",
            "twin_passes_at_replay_speed": at_replay.twin_passes if at_replay else ""}


def _read_errors(path: Path) -> dict[str, dict[str, str]]:
    with open(path) as f:
        return {r["metric"]: r for r in csv.DictReader(f)}


def _error(row: dict[str, str]) -> float:
    return float(row["rel_error_pct"]) if row["rel_error_pct"] not in ("", "nan") else math.nan


def format_table(rows: list[dict[str, object]]) -> str:
    """The issue's table: per workload and metric, real median, twin, error, spread, target;
    then the twin's error at the replays' own speed (``at replay``)."""
    head = (f"{'workload':<11} {'metric':<21} {'real (median)':>14} {'twin':>11} {'error':>8} "
            f"{'spread':>7} {'target':>7}  {'verdict':<7} {'at replay':>10}  verdict")
    lines = ["twin vs real on held-out workloads (error against the median of the replays; "
             "spread: half their range; at replay: the profile scaled to the speed the replays' "
             "own steps ran at)", head]
    for r in rows:
        target = r["target_pct"]
        lines.append(f"{r['workload']!s:<11} {r['metric']!s:<21} {float(r['real']):>14.4g} "  # type: ignore[arg-type]
                     f"{float(r['sim']):>11.4g} {float(r['error_pct']):>+7.1f}% "  # type: ignore[arg-type]
                     f"{float(r['spread_pct']):>6.1f}% "  # type: ignore[arg-type]
                     f"{(f'{target:g}%' if target != '' else ''):>7}  {r['verdict']!s:<7} "
                     f"{float(r['error_at_replay_speed_pct']):>+9.1f}%  "  # type: ignore[arg-type]
                     f"{r['verdict_at_replay_speed']}".rstrip())
    for column, what in (("verdict", "as calibrated"),
                         ("verdict_at_replay_speed", "at the replays' own speed")):
        judged = [r for r in rows if r[column]]
        within = sum(r[column] == "ok" for r in judged)
        by_spread = sum(r[column] == "~" for r in judged)
        lines.append(f"{within + by_spread}/{len(judged)} targeted metrics within target (or "
                     f"spread, ~), {what}: {within} within target, {by_spread} only by spread")
    spreads = [(float(r["spread_pct"]), float(r["target_pct"]))  # type: ignore[arg-type]
               for r in rows if r["verdict"]]
    lines.append(host_check(spreads))
    repeat_line = _repeat_summary(rows)
    return "\n".join([*lines, repeat_line] if repeat_line else lines)


def _repeat_summary(rows: list[dict[str, object]]) -> str:
    """The leave-one-out totals (``_repeat_columns``): the host's floor beside the twin."""
    judged = [r for r in rows if r.get("repeat_refs", "") != ""]
    if not judged:
        return ""
    total = sum(int(r["repeat_refs"]) for r in judged)  # type: ignore[call-overload]

    def passed(column: str) -> str:
        count = sum(int(r[column]) for r in judged if r[column] != "")  # type: ignore[call-overload]
        return f"{count} of {total} ({100 * count / total:.0f}%)"

    at_replay = (f", {passed('twin_passes_at_replay_speed')} at the replays' speed"
                 if any(r["twin_passes_at_replay_speed"] != "" for r in judged) else "")
    return (f"repeatability (each replay left out in turn, judged against the others' median "
            f"and spread): a real replay passed {passed('replay_passes')}; the twin against the "
            f"same references {passed('twin_passes')} as calibrated{at_replay}")
