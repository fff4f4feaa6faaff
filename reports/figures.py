"""The report's plotly figures. Each builder returns ``None`` when its data is absent (no steps.csv,
one tenant, one priority class, no simulator/real pair), so a page never shows an empty chart."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from twinserve.core.metrics import LATENCY_METRICS
from twinserve.reports.compare import COMPARED_METRICS, pair_sim_real, sim_vs_real
from twinserve.reports.fidelity import spread_pct
from twinserve.reports.runs import Run
from twinserve.reports.sampling import decimate_last, decimate_mean, ecdf_points, rate_in_windows
from twinserve.reports.stats import metric_values_ms
from twinserve.reports.tables import summary_table

PALETTE = qualitative.Plotly + qualitative.D3
METRIC_TITLES = {"ttft": "TTFT (ms)", "tpot": "TPOT (ms)", "itl": "ITL (ms)", "e2el": "E2EL (ms)"}
STEP_SERIES = (("num_waiting", "queue length (waiting)"), ("num_seqs", "batch size (seqs)"),
               ("kv_usage", "KV cache usage"))
SWEEP_PANELS = (
    ("request throughput (req/s)", ("request_throughput",)),
    ("output throughput (tok/s)", ("output_throughput",)),
    ("TTFT (ms): mean solid, p90 dashed", ("mean_ttft_ms", "p90_ttft_ms")),
    ("E2EL (ms): mean solid, p90 dashed", ("mean_e2el_ms", "p90_e2el_ms")),
)
FAIRNESS_WINDOWS = 100
LEGEND_LIFT_PX = 30
LOG_AXIS_SPREAD = 100.0  # a latency axis goes logarithmic when max / min exceeds this


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _base_layout(fig: go.Figure, title: str, height: int) -> go.Figure:
    """Title on top, then the legend in one row, then the subplot titles (which sit just above the
    plot area): the legend is lifted by LEGEND_LIFT_PX above the plot area, in paper units."""
    top, bottom = 110, 50
    fig.update_layout(title={"text": title, "y": 1 - 18 / height, "yanchor": "top"},
                      height=height, template="plotly_white",
                      margin={"l": 60, "r": 20, "t": top, "b": bottom},
                      legend={"orientation": "h", "yanchor": "bottom", "x": 0,
                              "y": 1 + LEGEND_LIFT_PX / (height - top - bottom)})
    return fig


def _wide_range(values: list[np.ndarray]) -> bool:
    """True when positive values span more than LOG_AXIS_SPREAD (a log axis reads better)."""
    pos = np.concatenate([v[v > 0] for v in values]) if values else np.array([])
    return len(pos) > 1 and pos.max() / pos.min() > LOG_AXIS_SPREAD


def latency_cdfs(runs: list[Run]) -> go.Figure | None:
    """TTFT, TPOT, ITL and E2EL empirical CDFs, one trace per run (one legend entry per run)."""
    values = {m: [metric_values_ms(run, m) for run in runs] for m in LATENCY_METRICS}
    if not any(len(v) for vs in values.values() for v in vs):
        return None
    fig = make_subplots(rows=2, cols=2, subplot_titles=[METRIC_TITLES[m] for m in LATENCY_METRICS],
                        horizontal_spacing=0.08, vertical_spacing=0.14)
    for k, metric in enumerate(LATENCY_METRICS):
        row, col = divmod(k, 2)
        for i, (run, vals) in enumerate(zip(runs, values[metric])):
            x, y = ecdf_points(vals)
            fig.add_trace(go.Scatter(
                x=x, y=y, mode="lines", name=run.display_name, legendgroup=run.display_name,
                showlegend=k == 0, line={"color": color(i)},
                hovertemplate="%{x:.1f} ms: %{y:.3f}<extra>" + run.display_name + "</extra>"),
                row=row + 1, col=col + 1)
        fig.update_yaxes(title_text="CDF", range=[0, 1.02], row=row + 1, col=col + 1)
        if _wide_range(values[metric]):
            fig.update_xaxes(type="log", row=row + 1, col=col + 1)
    return _base_layout(fig, "Latency CDFs (successful requests)", 760)


def sweep_frame(runs: list[Run], sweep: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """Rows of (series, request_rate, metrics...): ``sweep`` if given (series from its ``series``,
    ``backend`` or ``run`` column), else the runs whose config carries a finite ``request_rate``
    (series: backend, plus policy when named). ``None`` unless some series has two rates."""
    df = _sweep_from_table(sweep) if sweep is not None else _sweep_from_runs(runs)
    if df is None or df.empty:
        return None
    if df.groupby("series")["request_rate"].nunique().max() < 2:
        return None
    return df.sort_values(["series", "request_rate"])


def _sweep_from_table(sweep: pd.DataFrame) -> pd.DataFrame | None:
    if "request_rate" not in sweep.columns:
        raise ValueError("the sweep table needs a request_rate column")
    df = sweep.copy()
    label = next((c for c in ("series", "backend", "run") if c in df.columns), None)
    df["series"] = df[label].astype(str) if label else "sweep"
    df["request_rate"] = pd.to_numeric(df["request_rate"], errors="coerce")
    return df[np.isfinite(df["request_rate"])]


def _sweep_from_runs(runs: list[Run]) -> pd.DataFrame | None:
    rated = [r for r in runs if _finite_rate(r.config.get("request_rate"))]
    if not rated:
        return None
    df = summary_table(rated)
    df["request_rate"] = df["request_rate"].astype(float)
    df["series"] = [_series_name(r) for r in rated]
    return df


def _finite_rate(value: object) -> bool:
    try:
        return math.isfinite(float(value))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def _series_name(run: Run) -> str:
    policy = run.config.get("policy")
    return f"{run.backend} {policy}" if isinstance(policy, str) else run.backend


def rate_sweep(runs: list[Run], sweep: pd.DataFrame | None = None) -> go.Figure | None:
    """Throughput and latency against request rate, one line per series (p90 dashed)."""
    df = sweep_frame(runs, sweep)
    if df is None:
        return None
    fig = make_subplots(rows=2, cols=2, subplot_titles=[t for t, _ in SWEEP_PANELS],
                        horizontal_spacing=0.08, vertical_spacing=0.14)
    for i, (series, group) in enumerate(df.groupby("series", sort=True)):
        for k, (_, columns) in enumerate(SWEEP_PANELS):
            for j, column in enumerate(c for c in columns if c in group.columns):
                fig.add_trace(go.Scatter(
                    x=group["request_rate"], y=group[column], mode="lines+markers",
                    name=str(series), legendgroup=str(series), showlegend=k == 0,
                    line={"color": color(i), "dash": "dash" if j else "solid"},
                    hovertemplate=f"{column}: %{{y:.4g}} at %{{x:.3g}} req/s<extra>{series}</extra>"),
                    row=k // 2 + 1, col=k % 2 + 1)
    fig.update_xaxes(title_text="request rate (req/s)")
    return _base_layout(fig, "Throughput and latency against request rate", 760)


def speculation(table: pd.DataFrame) -> go.Figure | None:
    """Mean acceptance length and TPOT speedup over no speculation, a bar per speculating run
    (``tables.SPEC_COLUMNS``); None when no run speculated."""
    if "spec_mean_acceptance_length" not in table.columns:
        return None
    spec = table[table["spec_mean_acceptance_length"].notna()]
    if spec.empty:
        return None
    panels = [("Mean acceptance length (tokens per verification)", "spec_mean_acceptance_length"),
              ("Mean TPOT speedup over no speculation", "spec_tpot_speedup")]
    fig = make_subplots(rows=1, cols=2, subplot_titles=[t for t, _ in panels],
                        horizontal_spacing=0.1)
    for k, (_, column) in enumerate(panels):
        values = spec[column] if column in spec.columns else pd.Series(np.nan, index=spec.index)
        fig.add_trace(go.Bar(x=spec["run"], y=values, showlegend=False,
                             marker={"color": [color(i) for i in range(len(spec))]},
                             hovertemplate=f"{column}: %{{y:.3g}}<extra>%{{x}}</extra>"),
                      row=1, col=k + 1)
    fig.add_hline(y=1.0, line={"dash": "dot", "color": "gray"}, row=1, col=2)
    return _base_layout(fig, "Speculative decoding", 420)


TTFT_PARTS = (("queue", "queue (to the first prefill step)"), ("prefill", "prefill"),
              ("transfer", "KV transfer (wait + flow)"), ("decode", "decode (to the first token)"))


def disaggregation(table: pd.DataFrame) -> go.Figure | None:
    """Disaggregated runs (``tables.PD_COLUMNS``): each run's mean TTFT as its stacked parts, and
    the prefill and decode pools' utilisation; None when no run was disaggregated."""
    if "mean_ttft_transfer_ms" not in table.columns:
        return None
    pd_runs = table[table["mean_ttft_transfer_ms"].notna()]
    if pd_runs.empty:
        return None
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=["Mean TTFT by part (ms)", "Pool utilisation"])
    for k, (part, label) in enumerate(TTFT_PARTS):
        fig.add_trace(go.Bar(x=pd_runs["run"], y=pd_runs[f"mean_ttft_{part}_ms"], name=label,
                             marker={"color": color(k)}), row=1, col=1)
    for k, pool in enumerate(("prefill", "decode")):
        # markers, not bars: the left panel's bars stack, these two must not
        fig.add_trace(go.Scatter(x=pd_runs["run"], y=pd_runs[f"{pool}_utilization"],
                                 mode="markers", name=f"{pool} pool",
                                 marker={"color": color(k + 4), "size": 12}), row=1, col=2)
    fig.update_layout(barmode="stack")
    fig.update_yaxes(range=[0, 1.02], row=1, col=2)
    return _base_layout(fig, "Disaggregated prefill and decode", 420)


REPLICA_PANELS = ("requests served", "mean TTFT (ms)", "prefix hit rate")


def replica_table(requests: pd.DataFrame) -> pd.DataFrame:
    """A fleet's run per replica (its requests.csv ``replica`` column): the requests each
    served, their mean TTFT (successful ones) and the share of their prompt tokens the
    replica's prefix cache held."""
    ok = requests[requests["success"]]
    by = requests.groupby("replica")
    table = pd.DataFrame({"requests served": by.size()})
    table["mean TTFT (ms)"] = ok.groupby("replica")["ttft_ms"].mean()
    tokens = ok.groupby("replica")[["cached_tokens", "input_tokens"]].sum()
    table["prefix hit rate"] = tokens["cached_tokens"] / tokens["input_tokens"].where(
        tokens["input_tokens"] > 0)
    return table.sort_index()


def replicas(runs: list[Run]) -> go.Figure | None:
    """Per replica of each fleet's run (``replica_table``), one bar group per run: how a router
    spread the load and the prefix hits; None when no run names its requests' replicas."""
    fleets = [(i, r) for i, r in enumerate(runs) if "replica" in r.requests.columns]
    if not fleets:
        return None
    fig = make_subplots(rows=1, cols=len(REPLICA_PANELS), horizontal_spacing=0.08,
                        subplot_titles=list(REPLICA_PANELS))
    for i, run in fleets:
        table = replica_table(run.requests)
        for k, column in enumerate(REPLICA_PANELS):
            fig.add_trace(go.Bar(x=[f"replica {int(v)}" for v in table.index], y=table[column],
                                 name=run.display_name, legendgroup=run.display_name,
                                 showlegend=k == 0, marker={"color": color(i)}),
                          row=1, col=k + 1)
    fig.update_layout(barmode="group")
    fig.update_yaxes(range=[0, 1.02], row=1, col=len(REPLICA_PANELS))
    return _base_layout(fig, "Replicas behind a router (requests.csv's replica column)", 460)


def engine_timeseries(runs: list[Run]) -> go.Figure | None:
    """Queue length, batch size and KV usage over time from steps.csv, one trace per run, or
    per replica of a fleet's run (its replicas' states are each their own: one line through
    all of their steps would zigzag between them), a dash per replica."""
    with_steps = [(i, r, r.steps) for i, r in enumerate(runs) if r.steps is not None]
    if not with_steps:
        return None
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[t for _, t in STEP_SERIES])
    for i, run, run_steps in with_steps:
        for name, dash, engine_steps in _per_replica(run.display_name, run_steps):
            steps = decimate_mean(engine_steps.sort_values("time"), "time")
            for k, (column, _) in enumerate(STEP_SERIES):
                fig.add_trace(go.Scatter(
                    x=steps["time"], y=steps[column], mode="lines", name=name,
                    legendgroup=name, showlegend=k == 0,
                    line={"color": color(i), "dash": dash}), row=k + 1, col=1)
    fig.update_xaxes(title_text="time since run start (s)", row=3, col=1)
    fig.update_yaxes(range=[0, 1.02], row=3, col=1)
    return _base_layout(fig, "Engine state over time (steps.csv)", 820)


_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")


def _per_replica(name: str, steps: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """A run's steps as (trace name, dash, rows): the whole run where one engine stepped, else
    one entry per replica (``steps.csv``'s replica column)."""
    if "replica" not in steps.columns or steps["replica"].nunique() < 2:
        return [(name, "solid", steps)]
    return [(f"{name}, replica {int(k)}", _DASHES[j % len(_DASHES)], rows)
            for j, (k, rows) in enumerate(steps.groupby("replica", sort=True))]


def tenant_service(tenants: pd.DataFrame) -> pd.DataFrame:
    """tenants.csv with ``service`` = prefill_tokens + 2 * output_tokens (VTC's weights)."""
    out = tenants.copy()
    out["tenant"] = out["tenant"].astype(str)
    out["service"] = out["prefill_tokens"] + 2.0 * out["output_tokens"]
    return out.sort_values("time", kind="stable")


def _multi_tenant(run: Run) -> pd.DataFrame | None:
    """The run's tenants.csv when it holds two or more tenants."""
    tenants = run.tenants
    return tenants if tenants is not None and tenants["tenant"].nunique() > 1 else None


def fairness(runs: list[Run]) -> go.Figure | None:
    """Per run with two or more tenants: each tenant's service rate over time (left) and cumulative
    service (right); one colour per tenant across runs."""
    fair = [(r, tenants) for r in runs if (tenants := _multi_tenant(r)) is not None]
    if not fair:
        return None
    tenant_names = sorted({t for _, tenants in fair for t in tenants["tenant"].astype(str)})
    colors = {t: color(i) for i, t in enumerate(tenant_names)}
    titles = [t for r, _ in fair for t in (f"{r.display_name}: service rate (tok/s)",
                                        f"{r.display_name}: cumulative service (tokens)")]
    fig = make_subplots(rows=len(fair), cols=2, subplot_titles=titles, horizontal_spacing=0.08,
                        vertical_spacing=min(0.12, 0.3 / len(fair)))
    shown: set[str] = set()
    for row, (_, tenants) in enumerate(fair, start=1):
        _add_fairness_row(fig, tenant_service(tenants), row, colors, shown)
        fig.update_xaxes(title_text="time (s)", row=row)
    return _base_layout(fig, "Per-tenant service (prefill + 2 x output tokens)", 120 + 320 * len(fair))


def _add_fairness_row(fig: go.Figure, service: pd.DataFrame, row: int, colors: dict[str, str],
                      shown: set[str]) -> None:
    t0, t1 = float(service["time"].min()), float(service["time"].max())
    windows = max(1, min(FAIRNESS_WINDOWS, service["time"].nunique()))
    for tenant, group in service.groupby("tenant", sort=True):
        x, rate = rate_in_windows(group["time"], group["service"], t0, t1, windows)
        cum = decimate_last(group.assign(cum=group["service"].cumsum()), "time")
        style = {"name": tenant, "legendgroup": tenant, "line": {"color": colors[tenant]}}
        fig.add_trace(go.Scatter(x=x, y=rate, mode="lines", showlegend=tenant not in shown,
                                 **style), row=row, col=1)
        fig.add_trace(go.Scatter(x=cum["time"], y=cum["cum"], mode="lines", showlegend=False,
                                 **style), row=row, col=2)
        shown.add(tenant)


def _box_stats(values: np.ndarray) -> dict[str, float]:
    """Tukey box: quartiles, mean, whiskers at the furthest values within 1.5 IQR."""
    q1, med, q3 = np.percentile(values, [25, 50, 75])
    lo, hi = q1 - 1.5 * (q3 - q1), q3 + 1.5 * (q3 - q1)
    inside = values[(values >= lo) & (values <= hi)]
    return {"q1": q1, "median": med, "q3": q3, "mean": float(values.mean()),
            "lowerfence": float(inside.min()), "upperfence": float(inside.max())}


def ttft_by_priority(runs: list[Run]) -> go.Figure | None:
    """TTFT per priority class, one box per run and class (statistics precomputed: small pages)."""
    classes = sorted({int(p) for r in runs for p in r.ok_requests["priority"].unique()})
    if len(classes) < 2:
        return None
    fig = go.Figure()
    for i, run in enumerate(runs):
        ok = run.ok_requests.dropna(subset=["ttft_ms"])
        groups = [(p, g["ttft_ms"].to_numpy(dtype=float)) for p, g in ok.groupby("priority")]
        stats = [(f"priority {p}", _box_stats(v)) for p, v in groups if len(v)]
        if not stats:
            continue
        fig.add_trace(go.Box(
            x=[name for name, _ in stats], name=run.display_name, marker={"color": color(i)},
            **{k: [s[k] for _, s in stats] for k in stats[0][1]}))
    fig.update_layout(boxmode="group", yaxis_title="TTFT (ms)", xaxis_title="priority class")
    return _base_layout(fig, "TTFT by priority class", 480)


def sim_vs_real_figure(runs: list[Run]) -> go.Figure | None:
    """Every simulator/real pair: TTFT, TPOT and E2EL CDFs overlaid (simulator dashed), and the
    relative error of each compared metric as bars."""
    pairs = pair_sim_real(runs)
    if not pairs:
        return None
    metrics = ("ttft", "tpot", "e2el")
    fig = make_subplots(
        rows=2, cols=3, specs=[[{}, {}, {}], [{"colspan": 3}, None, None]],
        subplot_titles=[*(METRIC_TITLES[m] for m in metrics), "relative error (sim - real) / real"],
        vertical_spacing=0.16, horizontal_spacing=0.07)
    drawn: set[str] = set()
    for i, (sim, real) in enumerate(pairs):
        _add_pair_cdfs(fig, sim, real, metrics, color(i), drawn)
        errors = sim_vs_real(sim, real)
        fig.add_trace(go.Bar(
            x=list(COMPARED_METRICS), y=errors["rel_error"], name=f"{sim.name} vs {real.name}",
            marker={"color": color(i)}, texttemplate="%{y:.1%}", textposition="outside",
            cliponaxis=False),
            row=2, col=1)
    fig.update_yaxes(tickformat=".0%", row=2, col=1)
    fig.update_yaxes(title_text="CDF", range=[0, 1.02], row=1)
    return _base_layout(fig, "Simulation against reality", 820)


def _add_pair_cdfs(fig: go.Figure, sim: Run, real: Run, metrics: tuple[str, ...], c: str,
                   drawn: set[str]) -> None:
    """Adds the CDFs of a pair; a real run already drawn (paired with an earlier sim) is not redrawn."""
    todo = [(run, dash) for run, dash in ((real, "solid"), (sim, "dash"))
            if run.display_name not in drawn]
    drawn.update(run.display_name for run, _ in todo)
    for col, metric in enumerate(metrics, start=1):
        for run, dash in todo:
            x, y = ecdf_points(metric_values_ms(run, metric))
            fig.add_trace(go.Scatter(
                x=x, y=y, mode="lines", name=run.display_name, legendgroup=run.display_name,
                showlegend=col == 1, line={"color": c, "dash": dash}), row=1, col=col)


def twin_errors(judged: list[tuple[str, list[dict[str, Any]]]]) -> go.Figure | None:
    """Each twin's signed error (%) per targeted metric against the real replays' median
    (``fidelity.error_rows``), with the metric's target and the replays' spread as ticks."""
    if not judged:
        return None
    targeted = [row for row in judged[0][1] if row["target_pct"] != ""]
    if not targeted:
        return None
    metrics = [row["metric"] for row in targeted]
    fig = go.Figure()
    for i, (name, rows) in enumerate(judged):
        by_metric = {row["metric"]: row["rel_error_pct"] for row in rows}
        fig.add_trace(go.Bar(x=metrics, y=[by_metric[m] for m in metrics], name=name,
                             marker={"color": color(i)}, texttemplate="%{y:+.1f}%",
                             textposition="outside", cliponaxis=False))
    for name, values, symbol in (
            ("target", [float(row["target_pct"]) for row in targeted], "line-ew"),
            ("real spread", [spread_of(row) for row in targeted], "line-ew-open")):
        for sign in (1, -1):
            fig.add_trace(go.Scatter(
                x=metrics, y=[sign * v for v in values], mode="markers", name=f"± {name}",
                legendgroup=name, showlegend=sign == 1,
                marker={"symbol": symbol, "size": 28, "line": {"width": 2},
                        "color": "#444" if name == "target" else "#d62728"}))
    fig.update_layout(barmode="group", yaxis_title="(twin - real median) / real median, %")
    return _base_layout(fig, "Twin error against the real replays' median", 520)


def spread_of(row: dict[str, Any]) -> float:
    """The replays' spread of an error row in % (0 without several replays)."""
    value = spread_pct(row) if row.get("real_runs", 0) > 1 else 0.0
    return 0.0 if math.isnan(value) else value
