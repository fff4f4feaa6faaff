"""The summary table: one row per run, vLLM's benchmark key names as columns.

Values come from the run's ``summary.json``; keys it lacks are recomputed from ``requests.csv``
(``stats.request_metrics``). Goodput: with ``slos_ms`` given it is recomputed from ``requests.csv`` for
every run, so all runs are held to the same SLOs; without, the summary's ``request_goodput`` if any.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from twinserve.core.config import SchedulerConfig
from twinserve.core.engine_args import EngineArgs
from twinserve.reports.runs import Run
from twinserve.reports.stats import goodput, priority_stats, request_metrics

ID_COLUMNS = ("run", "backend", "folder")
LATENCY_COLUMNS = tuple(
    f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "p90", "p99"))
HEADLINE_COLUMNS = (
    "completed", "failed", "duration", "request_throughput", "output_throughput",
    "total_token_throughput", "request_goodput", *LATENCY_COLUMNS, "num_preemptions",
    "prefix_cache_hit_rate", "jain_index",
)
CONFIG_COLUMNS = ("request_rate", "model", "policy", "trace")
# A LoRA run's figures (``simulator.lora_run``), shown only for runs that have them.
LORA_COLUMNS = ("lora_loads", "lora_load_time_s", "num_lora_adapters", "lora_request_share")
# A speculating run's figures (vLLM's acceptance; ``spec_tpot_speedup``: the mean TPOT of the run
# without speculation of the same backend, trace and rate over this run's), shown only with them.
SPEC_COLUMNS = ("spec_mean_acceptance_length", "spec_draft_acceptance_rate", "spec_tpot_speedup")
# A disaggregated (prefill/decode) run's figures (``simulator.disaggregated.pool_summary``): the
# pools' utilisation, the KV transfers and the mean TTFT parts, shown only for such runs.
PD_COLUMNS = ("prefill_instances", "decode_instances", "prefill_utilization",
              "decode_utilization", "mean_kv_transfer_ms", "p90_kv_transfer_ms",
              "mean_ttft_queue_ms", "mean_ttft_prefill_ms", "mean_ttft_transfer_ms",
              "mean_ttft_decode_ms")


def summary_row(run: Run, slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """The table row of one run (see the module docstring for where each value comes from)."""
    merged = _merged_summary(run)
    row: dict[str, Any] = {"run": run.name, "backend": run.backend, "folder": str(run.path)}
    row.update({k: _scalar(run.config[k]) for k in CONFIG_COLUMNS if k in run.config})
    row.update({k: _number(merged.get(k)) for k in HEADLINE_COLUMNS})
    row["request_goodput"] = (
        goodput(run, slos_ms) if slos_ms else _number(run.summary.get("request_goodput")))
    row.update({k: _number(merged[k]) for k in LORA_COLUMNS if k in merged})
    row.update({k: _number(merged[k]) for k in SPEC_COLUMNS if k in merged})
    row.update({k: _number(merged[k]) for k in PD_COLUMNS if k in merged})
    service = merged.get("tenant_service") or {}
    row.update({f"service_{t}": float(v) for t, v in sorted(service.items())})
    row.update(priority_stats(run))
    return row


def summary_table(runs: list[Run], slos_ms: dict[str, float] | None = None) -> pd.DataFrame:
    """One row per run; per-tenant (``service_<tenant>``) and per-priority (``prio<p>_*``) columns
    are the union over the runs (NaN where a run has no such tenant or class)."""
    rows = [summary_row(run, slos_ms) for run in runs]
    _add_spec_speedups(rows, runs)
    df = pd.DataFrame(rows)
    return df[_ordered_columns(list(df.columns))]


def speculates(run: Run) -> bool:
    return bool(run.summary.get("spec_num_drafts"))


def _add_spec_speedups(rows: list[dict[str, Any]], runs: list[Run]) -> None:
    """``spec_tpot_speedup`` of each speculating run that has a baseline (module constant)."""
    def key(run: Run) -> tuple[Any, ...]:
        return (run.backend, *(_scalar(run.config.get(k)) for k in ("trace", "request_rate")))
    baselines: dict[tuple[Any, ...], float] = {}
    for run, row in zip(runs, rows):
        if not speculates(run):
            baselines.setdefault(key(run), row["mean_tpot_ms"])
    for run, row in zip(runs, rows):
        base = baselines.get(key(run))
        if speculates(run) and base is not None and row["mean_tpot_ms"] > 0:
            row["spec_tpot_speedup"] = base / row["mean_tpot_ms"]


def _merged_summary(run: Run) -> dict[str, Any]:
    """The summary's values over those recomputed from requests.csv (a null in the summary is a gap)."""
    merged = request_metrics(run)
    merged.update({k: v for k, v in run.summary.items() if v is not None})
    return merged


def _scalar(value: Any) -> Any:
    """Config values as table cells: numbers and text as they are, anything else as JSON text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def _ordered_columns(columns: list[str]) -> list[str]:
    fixed = [c for c in (*ID_COLUMNS, *CONFIG_COLUMNS, *HEADLINE_COLUMNS, *LORA_COLUMNS,
                         *SPEC_COLUMNS, *PD_COLUMNS) if c in columns]
    service = sorted(c for c in columns if c.startswith("service_"))
    prio = sorted((c for c in columns if c.startswith("prio")), key=_priority_sort_key)
    rest = [c for c in columns if c not in fixed and c not in service and c not in prio]
    return fixed + service + prio + rest


def _priority_sort_key(column: str) -> tuple[int, str]:
    head = column.split("_", 1)[0]  # "prio<p>"
    try:
        return int(head[4:]), column
    except ValueError:
        return 0, column


def write_table(df: pd.DataFrame, stem: str | Path) -> list[Path]:
    """Writes ``<stem>.csv`` and, when pyarrow imports, ``<stem>.parquet``; returns the paths."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path = stem.parent / f"{stem.name}.csv"
    df.to_csv(csv_path, index=False)
    paths = [csv_path]
    if _has_pyarrow():
        parquet_path = stem.parent / f"{stem.name}.parquet"
        _uniform_types(df).to_parquet(parquet_path, index=False, engine="pyarrow")
        paths.append(parquet_path)
    return paths


def _uniform_types(df: pd.DataFrame) -> pd.DataFrame:
    """Parquet needs one type per column: a text column mixing types (a rate given as 2.0 in one
    config and "inf" in another) is written as text."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object and out[col].dropna().map(type).nunique() > 1:
            out[col] = out[col].map(lambda v: None if pd.isna(v) else str(v))
    return out


def _has_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


# The keys of a run's config.json that describe the engine (EngineArgs, their resolved values and
# the twin's own keys): the report lists those whose values differ between the runs compared.
ENGINE_CONFIG_KEYS = (*EngineArgs.field_names(), *SchedulerConfig.field_names(), "usage_context",
                      "device_type", "dtype", "kv_cache_bytes", "block_bytes", "hardware",
                      "num_replicas", "router")


def config_differences(runs: list[Run]) -> pd.DataFrame:
    """One row per engine key whose value is not the same in every run (a run without the key
    shows ``None``); columns ``key`` and one per run name."""
    rows = []
    for key in dict.fromkeys(ENGINE_CONFIG_KEYS):
        if not any(key in r.config for r in runs):
            continue
        values = [r.config.get(key) for r in runs]
        if any(json.dumps(v, sort_keys=True, default=str) !=
               json.dumps(values[0], sort_keys=True, default=str) for v in values[1:]):
            rows.append({"key": key, **{r.name: _scalar(v) for r, v in zip(runs, values)}})
    return pd.DataFrame(rows, columns=["key", *(r.name for r in runs)])
