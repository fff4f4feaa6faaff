"""Reducing long series to at most a few thousand points per trace, so report pages stay small."""

from __future__ import annotations

import numpy as np
import pandas as pd

MAX_POINTS = 2000


def ecdf_points(values: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """(x, F(x)) of the empirical CDF; above ``max_points`` values, the quantiles at ``max_points``
    evenly spaced probabilities (the curve's shape, exact at those points)."""
    vals = np.sort(np.asarray(values, dtype=float))
    vals = vals[~np.isnan(vals)]
    n = len(vals)
    if n <= max_points:
        return vals, np.arange(1, n + 1) / n
    probs = np.linspace(1.0 / n, 1.0, max_points)
    return np.quantile(vals, probs, method="inverted_cdf"), probs


def _bin_index(times: pd.Series, bins: int) -> pd.Series:
    t0, t1 = float(times.min()), float(times.max())
    span = max(t1 - t0, 1e-12)
    return ((times - t0) / span * bins).clip(upper=bins - 1).astype(int)


def decimate_mean(df: pd.DataFrame, time_col: str, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """``df`` as is when short; else the mean of every column over ``max_points`` equal time bins."""
    if len(df) <= max_points:
        return df
    return df.groupby(_bin_index(df[time_col], max_points)).mean(numeric_only=True)


def decimate_last(df: pd.DataFrame, time_col: str, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """``df`` as is when short; else the last row of each of ``max_points`` equal time bins (exact
    for a cumulative series at the bin ends)."""
    if len(df) <= max_points:
        return df
    return df.groupby(_bin_index(df[time_col], max_points)).last()


def rate_in_windows(times: pd.Series, amounts: pd.Series, t0: float, t1: float,
                    windows: int) -> tuple[np.ndarray, np.ndarray]:
    """(window centres, sum of ``amounts`` per window / window length) over [t0, t1]."""
    width = max(t1 - t0, 1e-12) / windows
    idx = ((times - t0) / width).clip(lower=0, upper=windows - 1).astype(int)
    sums = np.bincount(idx.to_numpy(), weights=amounts.to_numpy(dtype=float), minlength=windows)
    centres = t0 + (np.arange(windows) + 0.5) * width
    return centres, sums / width
