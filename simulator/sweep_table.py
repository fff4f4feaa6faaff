"""The sweep table (``sweep.csv``): one row per grid point, read back from its run folder.

A row holds the point's identity (id, name, series, folder), its axis values, its full simulation
config, its summary metrics, its SLO attainment and goodput (when the spec has SLOs) and, when the
workload has several tenants, each tenant's mean and p90 TTFT.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from twinserve.simulator.run import SimConfig
from twinserve.simulator.sweep_spec import SloSpec, SweepPoint

TENANT_TTFT_PERCENTILE = 90


def point_row(point: SweepPoint, folder: Path, slo: SloSpec | None,
              shown_folder: str) -> dict[str, Any]:
    """One sweep.csv row: the point's config, its summary metrics and its SLO attainment.
    ``folder`` is the point's run folder, ``shown_folder`` the path the row names it by."""
    config = json.loads((folder / "config.json").read_text())
    summary = json.loads((folder / "summary.json").read_text())
    requests = pd.read_csv(folder / "requests.csv", usecols=["tenant", "success", "ttft_ms",
                                                              "tpot_ms", "e2el_ms"])
    requests["success"] = requests["success"].astype(bool)
    rate = point.workload["request_rate"]
    row: dict[str, Any] = {"point_id": point.point_id, "name": point.name, "series": point.series,
                           "folder": shown_folder, **point.axes}
    sim = SimConfig.from_flat(point.sim).flat()
    sim.pop("label")
    sim["num_gpu_blocks"] = config.get("num_gpu_blocks")  # as derived
    row.update({k: _cell(v) for k, v in {**sim, **point.workload}.items() if k not in row})
    row["request_rate"] = rate if rate is not None else config.get("trace_request_rate")
    row["num_requests_run"] = len(requests)
    row.update(summary_metrics(summary))
    if slo is not None:
        row.update(slo_metrics(requests, slo, float(summary["duration"])))
    row.update(tenant_ttft(requests))
    return row


def _cell(value: Any) -> Any:
    """A config value as a CSV cell (tables and lists as JSON, None as empty)."""
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value


def summary_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's scalars (null as NaN), and ``tenant_service_<tenant>`` per tenant."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            out.update({f"{key}_{k}": v for k, v in sorted(value.items())})
        else:
            out[key] = math.nan if value is None else value
    return out


def slo_metrics(requests: pd.DataFrame, slo: SloSpec, duration_s: float) -> dict[str, float]:
    """``slo_attainment``: the fraction of all requests that succeeded and met every SLO (an unknown
    value, e.g. the TPOT of a one-token reply, passes); ``request_goodput``: those per second."""
    good = requests["success"].copy()
    for key, limit in slo.slos_ms.items():
        col = requests[f"{key}_ms"]
        good &= col.isna() | (col <= limit)
    count = int(good.sum())
    return {"slo_attainment": count / len(requests) if len(requests) else math.nan,
            "request_goodput": count / max(duration_s, 1e-9)}


def tenant_ttft(requests: pd.DataFrame) -> dict[str, float]:
    """Per tenant (when there are two or more): mean and p90 TTFT of its successful requests."""
    ok = requests[requests["success"]]
    if ok["tenant"].nunique() < 2:
        return {}
    out = {}
    for tenant, group in ok.groupby("tenant", sort=True):
        ttft = group["ttft_ms"].dropna().to_numpy(dtype=float)
        out[f"tenant_{tenant}_mean_ttft_ms"] = float(ttft.mean()) if len(ttft) else math.nan
        out[f"tenant_{tenant}_p{TENANT_TTFT_PERCENTILE}_ttft_ms"] = (
            float(np.percentile(ttft, TENANT_TTFT_PERCENTILE)) if len(ttft) else math.nan)
    return out
