"""How well the real engine predicts itself: the floor under the twin's error on a noisy host.

With three or more real runs of one workload, each run is set against the others as the twin
is set against all of them: its error against the median of the other runs, judged by
``fidelity.verdict`` (the metric's target, or the other runs' spread where larger). The twin is
judged against the very same other runs. ``replay_passes`` of ``runs`` says how often a repeat
of the real run would have passed where the twin is asked to; ``twin_passes`` how often the twin
did against the same references. On a host whose speed moves 10% between runs the first can
fall well below ``runs``: there the host, not the twin, bounds what any prediction can meet.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from twinserve.reports.compare import relative_error
from twinserve.reports.fidelity import TARGETS, as_number, half_range_pct, verdict

REPEATABILITY_COLUMNS = ("metric", "runs", "replay_passes", "twin_passes")


@dataclass(slots=True, frozen=True)
class Repeatability:
    """One targeted metric over ``runs`` leave-one-out references (see the module)."""

    metric: str
    runs: int
    replay_passes: int
    twin_passes: int

    def __post_init__(self) -> None:
        if self.runs < 3:
            raise ValueError(f"{self.metric}: repeatability needs at least 3 runs, got {self.runs}.")
        for name in ("replay_passes", "twin_passes"):
            if not 0 <= getattr(self, name) <= self.runs:
                raise ValueError(f"{self.metric}: {name} must be within 0..{self.runs}.")


def left_out(values: Sequence[float]) -> list[tuple[float, list[float]]]:
    """Each value with the others (the references a repeat of one run is judged against)."""
    return [(value, [*values[:i], *values[i + 1:]]) for i, value in enumerate(values)]


def error_pct(value: float, reference: float) -> float:
    """``compare.relative_error`` in %: 0 when both are 0, nan when only the reference is."""
    return 100.0 * relative_error(value, reference)


def leave_one_out(metric: str, reals: Sequence[float], sim: float,
                  target: float) -> Repeatability | None:
    """Each real value and the twin's (``sim``) against the median and spread of the other real
    values; ``None`` with fewer than 3 finite real values or no finite ``sim``."""
    values = [v for v in reals if math.isfinite(v)]
    if len(values) < 3 or not math.isfinite(sim):
        return None
    replay = twin = 0
    for value, others in left_out(values):
        middle = float(np.median(others))
        spread = half_range_pct(min(others), max(others), middle)
        replay += verdict(error_pct(value, middle), target, spread) in ("ok", "~")
        twin += verdict(error_pct(sim, middle), target, spread) in ("ok", "~")
    return Repeatability(metric, len(values), replay, twin)


def repeatability(reals: Sequence[Mapping[str, Any]], sim: Mapping[str, Any]) -> list[Repeatability]:
    """``leave_one_out`` of every targeted metric (``fidelity.TARGETS``) of the real runs'
    summaries ``reals`` and the twin's ``sim``; empty with fewer than 3 runs."""
    rows = []
    for metric, target in TARGETS:
        if target is None:
            continue
        row = leave_one_out(metric, [as_number(r.get(metric)) for r in reals], as_number(sim.get(metric)),
                            target)
        if row is not None:
            rows.append(row)
    return rows


def format_repeatability(rows: Sequence[Repeatability], twin: str = "the twin") -> str:
    """One line: how many leave-one-out judgements a real run and ``twin`` passed."""
    if not rows:
        return ""
    total = sum(r.runs for r in rows)
    replay = sum(r.replay_passes for r in rows)
    twin_passes = sum(r.twin_passes for r in rows)
    return (f"repeatability: each real run against the median of the others, judged as {twin} "
            f"is, passed {replay} of {total} ({len(rows)} metrics x runs); {twin} against the "
            f"same references passed {twin_passes} of {total}")


def write_repeatability(path: Path, rows: Sequence[Repeatability]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(REPEATABILITY_COLUMNS)
        w.writerows((r.metric, r.runs, r.replay_passes, r.twin_passes) for r in rows)
    return path


def read_repeatability(path: Path) -> dict[str, Repeatability]:
    """``write_repeatability``'s rows by metric (empty when the file does not exist)."""
    if not path.is_file():
        return {}
    with open(path, newline="") as f:
        return {r["metric"]: Repeatability(r["metric"], int(r["runs"]), int(r["replay_passes"]),
                                           int(r["twin_passes"])) for r in csv.DictReader(f)}

