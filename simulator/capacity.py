"""The capacity of a configuration, as Vidur-Search defines it.

The highest request rate at which the fraction of requests meeting every SLO (``slo_attainment``) is
at least the target; between that grid rate and the next one (which misses), the crossing is
interpolated linearly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

CAPACITY_COLUMNS = ("capacity_rps", "max_rate_meeting_slo", "attainment_at_capacity", "status")


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
