"""Run metrics recomputed from ``requests.csv``, under the same conventions as ``core.metrics``.

Used where a summary lacks a key (a vLLM client-side run writes fewer), for goodput under SLOs chosen at
report time, and for what no summary holds (per-priority-class latencies).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from twinserve.core.metrics import LATENCY_METRICS, PERCENTILES, jain_index
from twinserve.reports.runs import Run, itl_values_ms

SLO_KEYS = ("ttft", "tpot", "e2el")
PRIORITY_METRICS = ("ttft", "e2el")


def latency_stats(name: str, values_ms: np.ndarray | pd.Series) -> dict[str, float]:
    """mean, median, std and percentiles (numpy's linear interpolation, as ``core.metrics``)."""
    vals = np.asarray(values_ms, dtype=float)
    vals = vals[~np.isnan(vals)]
    if not len(vals):
        keys = ["mean", "median", "std", *(f"p{p}" for p in PERCENTILES)]
        return {f"{k}_{name}_ms": math.nan for k in keys}
    out = {f"mean_{name}_ms": float(vals.mean()), f"median_{name}_ms": float(np.percentile(vals, 50)),
           f"std_{name}_ms": float(vals.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(vals, p)) for p in PERCENTILES})
    return out


def metric_values_ms(run: Run, metric: str) -> np.ndarray:
    """A latency metric's values in ms over the successful requests (per token for ``itl``)."""
    if metric == "itl":
        return itl_values_ms(run.requests)
    if metric not in LATENCY_METRICS:
        raise ValueError(f"metric must be one of {LATENCY_METRICS}, got {metric!r}")
    vals = run.ok_requests[f"{metric}_ms"].to_numpy(dtype=float)
    return vals[~np.isnan(vals)]


def run_duration_s(run: Run) -> float:
    """The summary's duration, else last finish - first arrival (as ``core.metrics.summarize``)."""
    duration = run.summary.get("duration")
    if duration is not None:
        return float(duration)
    req = run.requests
    last = req.loc[req["success"], "finish_time"].max()
    first = req["arrival_time"].min()
    span = (0.0 if pd.isna(last) else last) - (0.0 if pd.isna(first) else first)
    return max(float(span), 1e-9)


def meets_slos(requests: pd.DataFrame, slos_ms: dict[str, float]) -> pd.Series:
    """Per request: meets every SLO (an unknown value, e.g. TPOT of a one-token reply, passes)."""
    unknown = [k for k in slos_ms if k not in SLO_KEYS]
    if unknown:
        raise ValueError(f"slos_ms keys must be among {SLO_KEYS}, got {unknown}")
    ok = pd.Series(True, index=requests.index)
    for key, limit in slos_ms.items():
        col = requests[f"{key}_ms"]
        ok &= col.isna() | (col <= limit)
    return ok


def goodput(run: Run, slos_ms: dict[str, float]) -> float:
    """Requests per second that succeeded and met every SLO."""
    good = meets_slos(run.ok_requests, slos_ms)
    return float(good.sum()) / run_duration_s(run)


def tenant_service(requests: pd.DataFrame) -> dict[str, float]:
    """Per tenant: input tokens + 2 * output tokens of the successful requests (VTC's weights)."""
    ok = requests[requests["success"]]
    service = ok["input_tokens"] + 2.0 * ok["output_tokens"]
    return {str(t): float(v) for t, v in service.groupby(ok["tenant"]).sum().sort_index().items()}


def request_metrics(run: Run) -> dict[str, float | dict[str, float]]:
    """The summary keys that ``requests.csv`` implies (throughputs, latency stats, preemptions,
    prefix-cache hit rate, tenant service and Jain's index)."""
    req, ok = run.requests, run.ok_requests
    duration = run_duration_s(run)
    in_tok, out_tok = float(ok["input_tokens"].sum()), float(ok["output_tokens"].sum())
    out: dict[str, float | dict[str, float]] = {
        "duration": duration, "completed": float(len(ok)), "failed": float(len(req) - len(ok)),
        "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
        "total_token_throughput": (in_tok + out_tok) / duration,
        "num_preemptions": float(req["num_preemptions"].sum()),
        "prefix_cache_hit_rate": float(ok["cached_tokens"].sum()) / in_tok if in_tok else 0.0,
    }
    for metric in (*LATENCY_METRICS, "queue"):
        values = metric_values_ms(run, metric) if metric != "queue" else ok["queue_ms"]
        out.update(latency_stats(metric, values))
    service = tenant_service(req)
    out["tenant_service"] = service
    out["jain_index"] = jain_index(list(service.values()))
    return out


def priority_stats(run: Run) -> dict[str, float]:
    """Per priority class: mean and p90 of TTFT and E2EL, as ``prio{p}_mean_ttft_ms``..."""
    ok = run.ok_requests
    out: dict[str, float] = {}
    for prio, group in ok.groupby("priority"):
        for metric in PRIORITY_METRICS:
            vals = group[f"{metric}_ms"].dropna().to_numpy(dtype=float)
            out[f"prio{prio}_mean_{metric}_ms"] = float(vals.mean()) if len(vals) else math.nan
            out[f"prio{prio}_p90_{metric}_ms"] = (
                float(np.percentile(vals, 90)) if len(vals) else math.nan)
    return out
