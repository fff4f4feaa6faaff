"""Comparison reports over run folders (``twinserve.core.run_dir``): tables, plotly figures and one
self-contained HTML page. Reads files only; imports no backend."""

from twinserve.reports.compare import (
    COMPARED_METRICS,
    pair_sim_real,
    relative_error,
    sim_vs_real,
    sim_vs_real_table,
)
from twinserve.reports.figures import (
    engine_timeseries,
    fairness,
    latency_cdfs,
    rate_sweep,
    sim_vs_real_figure,
    ttft_by_priority,
)
from twinserve.reports.html import write_report
from twinserve.reports.runs import NotARunFolderError, Run, load_run, load_runs
from twinserve.reports.stats import goodput, priority_stats, request_metrics
from twinserve.reports.tables import summary_table, write_table

__all__ = [
    "COMPARED_METRICS", "NotARunFolderError", "Run", "engine_timeseries", "fairness", "goodput",
    "latency_cdfs", "load_run", "load_runs", "pair_sim_real", "priority_stats", "rate_sweep",
    "relative_error", "request_metrics", "sim_vs_real", "sim_vs_real_figure", "sim_vs_real_table",
    "summary_table", "ttft_by_priority", "write_report", "write_table",
]
