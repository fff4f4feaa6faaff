"""The report of a sweep: ``write_report`` over representative points, with the sweep table."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from twinserve.reports.html import write_report

REPORT_ALL_MAX = 8  # a sweep of at most this many points is reported whole


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


def write_sweep_report(sweep: pd.DataFrame, capacity: pd.DataFrame | None, out: Path,
                       slos_ms: dict[str, float] | None, title: str) -> Path:
    """``OUT/report.html`` over ``report_points``; the sweep's folders are relative to ``out``."""
    dirs = [out / folder for folder in report_points(sweep, capacity)]
    return write_report(dirs, out / "report.html", slos_ms=slos_ms, title=title, sweep=sweep)
