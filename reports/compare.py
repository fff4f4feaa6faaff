"""Simulation against reality: the relative error of the twin, metric by metric.

relative error = (sim - real) / real, signed (positive: the simulator over-estimates). Where the real
value is 0 the error is 0 if the simulator also says 0, else NaN (undefined; both raw values stay in
the table).
"""

from __future__ import annotations

import math

import pandas as pd

from twinserve.reports.runs import Run
from twinserve.reports.tables import summary_row

COMPARED_METRICS = (
    "request_throughput", "output_throughput", "mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms",
    "median_e2el_ms", "p90_e2el_ms", "num_preemptions", "prefix_cache_hit_rate",
)
# config keys that say two runs served the same workload, most telling first
PAIRING_KEYS = ("trace", "request_rate", "model", "num_prompts", "seed", "scheduling_policy",
                "policy", "router")
# The same workload: the same trace slice at the same rate.
REQUIRED_KEYS = ("trace", "request_rate", "num_requests", "time_scale", "time_window")


def relative_error(sim: float, real: float) -> float:
    if math.isnan(sim) or math.isnan(real):
        return math.nan
    if real == 0:
        return 0.0 if sim == 0 else math.nan
    return (sim - real) / real


def sim_vs_real(sim: Run, real: Run, metrics: tuple[str, ...] = COMPARED_METRICS) -> pd.DataFrame:
    """One row per metric: ``metric, sim, real, rel_error, abs_rel_error`` plus the two run names."""
    sim_row, real_row = summary_row(sim), summary_row(real)
    rows = []
    for metric in metrics:
        s, r = float(sim_row.get(metric, math.nan)), float(real_row.get(metric, math.nan))
        err = relative_error(s, r)
        rows.append({"sim_run": sim.name, "real_run": real.name, "real_backend": real.backend,
                     "metric": metric, "sim": s, "real": r, "rel_error": err,
                     "abs_rel_error": abs(err)})
    return pd.DataFrame(rows)


def pair_sim_real(runs: list[Run]) -> list[tuple[Run, Run]]:
    """Pairs every simulator run with a real run (any other backend) of the same workload: the
    ``REQUIRED_KEYS`` must be equal where both configs carry them; among those candidates, the one
    agreeing on the most of ``PAIRING_KEYS`` (then on the earlier keys; the first on a tie).
    A simulator run without a candidate stays unpaired."""
    real = [r for r in runs if not r.is_sim]
    pairs = []
    for sim in (r for r in runs if r.is_sim):
        candidates = [r for r in real if _same_workload(sim, r)]
        if candidates:
            pairs.append((sim, max(candidates, key=lambda r: _agreement(sim, r))))
    return pairs


def _same_workload(a: Run, b: Run) -> bool:
    return all(a.config[k] == b.config[k] for k in REQUIRED_KEYS if k in a.config and k in b.config)


def _agreement(a: Run, b: Run) -> tuple[int, tuple[int, ...]]:
    """(number of keys agreeing, which ones) so that more agreement wins, then the earlier keys."""
    same = tuple(int(k in a.config and a.config.get(k) == b.config.get(k)) for k in PAIRING_KEYS)
    return sum(same), same


def sim_vs_real_table(runs: list[Run]) -> pd.DataFrame:
    """The error rows of every simulator/real pair among ``runs`` (empty frame when none)."""
    frames = [sim_vs_real(sim, real) for sim, real in pair_sim_real(runs)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
