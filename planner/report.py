"""``plan.html``: the two Pareto fronts over every configuration that met the SLOs, the searched
space (capacity against GPUs, by status) and the top of the ranking, on the reports package's page
(``reports.html.render_page``: self-contained, plotly.js embedded once, self-checking)."""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from twinserve.planner.output import FRONTS, TOP_COLUMNS, capacity_text, lower_bound_note
from twinserve.planner.plan import FITTED, PlanResult
from twinserve.reports.figures import color
from twinserve.reports.html import _table_html, render_page

STATUS_ORDER = ("fitted", "no-capacity", "dominated", "pruned-memory")


def front_figure(plan: pd.DataFrame, front: pd.DataFrame, name: str, x: str, y: str) -> go.Figure | None:
    fitted = plan[plan["status"] == FITTED]
    if fitted.empty:
        return None
    fig = go.Figure()
    for i, (hardware, group) in enumerate(fitted.groupby("hardware", sort=True)):
        fig.add_trace(go.Scatter(x=group[x], y=group[y], mode="markers", name=str(hardware),
                                 text=group["name"], marker={"color": color(i), "size": 8},
                                 hovertemplate="%{text}<br>%{x:.4g}, %{y:.4g}<extra></extra>"))
    on = front[front["front"] == name].sort_values("x_value")
    fig.add_trace(go.Scatter(x=on["x_value"], y=on["y_value"], mode="lines", name="front",
                             line={"color": "black", "dash": "dot"}, hoverinfo="skip"))
    fig.update_layout(title=f"Pareto front: {y} against {x}", xaxis_title=x, yaxis_title=y,
                      height=480, template="plotly_white")
    return fig


def space_figure(plan: pd.DataFrame) -> go.Figure:
    """Every configuration: GPUs against capacity (searched ones), by status."""
    fig = go.Figure()
    for i, status in enumerate(STATUS_ORDER):
        group = plan[plan["status"] == status]
        if group.empty:
            continue
        y = group["capacity_rps"].fillna(0.0)
        fig.add_trace(go.Scatter(x=group["gpus"], y=y, mode="markers", name=f"{status} ({len(group)})",
                                 text=group["name"] + "<br>" + group["reason"].fillna("").astype(str),
                                 marker={"color": color(i), "size": 7, "opacity": 0.7},
                                 hovertemplate="%{text}<br>%{y:.4g} req/s<extra></extra>"))
    fig.update_layout(title="The searched space (capacity 0: not searched or none)",
                      xaxis_title="GPUs", yaxis_title="capacity (req/s)", height=480,
                      template="plotly_white")
    return fig


def write_report(result: PlanResult, front: pd.DataFrame, path: Path, title: str,
                 settings: str) -> Path:
    plan = pd.DataFrame(result.rows)
    built = [(f"Front: {name}", front_figure(plan, front, name, x, y), "no configuration met the SLOs")
             for name, x, y, _, _ in FRONTS]
    built.append(("The searched space", space_figure(plan), ""))
    stats = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in result.stats.items())
    fitted = result.fitted()[:10]
    top = [[capacity_text(r) if c == "capacity_rps" else
            r[c] if not isinstance(r[c], float) else f"{r[c]:.4g}" for c in TOP_COLUMNS]
           for r in fitted]
    note = lower_bound_note(fitted, result.stats.get("requests_per_replay"))
    body = [f'<p class="meta">{html.escape(settings)}</p>', f'<p class="meta">{html.escape(stats)}</p>',
            "<h2>Top configurations (the cheapest per output token first)</h2>",
            _table_html(list(TOP_COLUMNS), top) if top else '<p class="note">None met the SLOs.</p>']
    if note is not None:
        body.append(f'<p class="note">{html.escape(note)}</p>')
    path.write_text(render_page(title, body, built), encoding="utf-8")
    return path
