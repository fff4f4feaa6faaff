"""One self-contained HTML report comparing run folders (opens offline: plotly.js is embedded once).

The page: a header saying what was compared, the summary table (metrics as rows, runs as columns),
the simulator's relative errors when runs of both kinds are given, then the figures; a figure without
data is replaced by a one-line note. The summary table is also written beside the page as
``<stem>.csv`` (+ ``<stem>.parquet``), and the errors as ``<stem>_sim_vs_real.csv`` when any.

The page checks itself: ``<body data-plots-expected=N>`` is the number of figures written, and after
load a script sets ``data-plots-rendered`` to the number of plotly divs that hold an SVG.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from twinserve.reports import figures
from twinserve.reports.compare import sim_vs_real_table
from twinserve.reports.runs import Run, load_runs
from twinserve.reports.tables import config_differences, summary_table, write_table

Builder = Callable[[list[Run], pd.DataFrame | None], go.Figure | None]
# (section title, figure builder, note shown when the builder has no data)
SECTIONS: tuple[tuple[str, Builder, str], ...] = (
    ("Latency distributions", lambda runs, sweep: figures.latency_cdfs(runs),
     "no successful request in any run."),
    ("Load sweep", figures.rate_sweep,
     "needs runs (or a sweep table) with at least two request rates of one backend."),
    ("Engine state over time", lambda runs, sweep: figures.engine_timeseries(runs),
     "no run has steps.csv (client-side runs record no engine steps)."),
    ("Fairness between tenants", lambda runs, sweep: figures.fairness(runs),
     "no run served two or more tenants with tenants.csv recorded."),
    ("TTFT by priority class", lambda runs, sweep: figures.ttft_by_priority(runs),
     "every request has the same priority class."),
    ("Speculative decoding", lambda runs, sweep: figures.speculation(summary_table(runs)),
     "no run verified draft tokens."),
    ("Replicas behind a router", lambda runs, sweep: figures.replicas(runs),
     "no run has replicas behind a router."),
    ("Disaggregated prefill and decode",
     lambda runs, sweep: figures.disaggregation(summary_table(runs)),
     "no run was disaggregated (prefill and decode instances)."),
    ("Simulation against reality", lambda runs, sweep: figures.sim_vs_real_figure(runs),
     "needs a simulator run (backend sim) and a real one (twinserve or vllm) of the same trace "
     "and request rate."),
)
HEADER_CONFIG_KEYS = ("model", "hardware", "cost_model", "policy", "trace", "request_rate")
RENDER_CHECK = """<script>
(function () {
  var tries = 0;
  function count() {
    var n = 0;
    document.querySelectorAll(".js-plotly-plot").forEach(function (d) {
      if (d.querySelector("svg.main-svg")) { n += 1; }
    });
    document.body.setAttribute("data-plots-rendered", String(n));
    var expected = Number(document.body.getAttribute("data-plots-expected"));
    if (n < expected && tries < 50) { tries += 1; setTimeout(count, 100); }
  }
  window.addEventListener("load", count);
})();
</script>"""
STYLE = """<style>
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 24px 32px;
       color: #222; background: #fff; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.25em; margin-top: 1.6em;
     border-bottom: 1px solid #ddd; padding-bottom: 4px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f4f6f8; } td.key, th.key { text-align: left; font-family: ui-monospace, monospace; }
tr:nth-child(even) td { background: #fafbfc; }
p.note { color: #666; font-style: italic; } .meta { color: #555; font-size: 13px; }
.scroll { overflow-x: auto; }
</style>"""


def write_report(
    run_dirs: Sequence[Path | str],
    out: Path | str,
    slos_ms: dict[str, float] | None = None,
    title: str = "twinserve run comparison",
    sweep: pd.DataFrame | None = None,
) -> Path:
    """Writes the report page ``out`` (and the tables beside it) and returns its path."""
    if not run_dirs:
        raise ValueError("run_dirs is empty: give at least one run folder")
    return write_runs_page(load_runs(list(run_dirs)), out, slos_ms, title, sweep)


def write_runs_page(runs: list[Run], out: Path | str, slos_ms: dict[str, float] | None = None,
                    title: str = "twinserve run comparison", sweep: pd.DataFrame | None = None,
                    sections: Sequence[tuple[str, Builder, str]] = SECTIONS,
                    intro: str = "") -> Path:
    """``write_report`` over runs already loaded (and named); ``sections``: the figures shown,
    ``intro``: HTML placed under the title (links to sibling pages)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = summary_table(runs, slos_ms)
    write_table(table, out.parent / out.stem)
    errors = sim_vs_real_table(runs)
    if not errors.empty:
        errors.to_csv(out.parent / f"{out.stem}_sim_vs_real.csv", index=False)
    built = [(name, builder(runs, sweep), note) for name, builder, note in sections]
    body = [intro, header_html(runs, slos_ms), "<h2>Summary</h2>", summary_html(table)]
    if len(runs) > 1:
        body += ["<h2>Engine configuration: what differs</h2>", config_html(runs)]
    if not errors.empty:
        body += ["<h2>Simulator error</h2>", errors_html(errors)]
    out.write_text(render_page(title, body, built), encoding="utf-8")
    return out


def render_page(title: str, body: list[str], built: list[tuple[str, go.Figure | None, str]]) -> str:
    """The whole page: ``body`` (HTML blocks) under the title, then the figure sections."""
    expected = sum(fig is not None for _, fig, _ in built)
    figures_html = [section_html(k, name, fig, note) for k, (name, fig, note) in enumerate(built)]
    plotly = [f'<script type="text/javascript">{get_plotlyjs()}</script>'] if expected else []
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>", STYLE, *plotly, "</head>",
        f'<body data-plots-expected="{expected}">', f"<h1>{html.escape(title)}</h1>",
        *(b for b in body if b), *figures_html, RENDER_CHECK, "</body>", "</html>", ""])


def header_html(runs: list[Run], slos_ms: dict[str, float] | None) -> str:
    keys = [k for k in HEADER_CONFIG_KEYS if any(k in r.config for r in runs)]
    head = ["run", "backend", *keys, "requests", "folder"]
    rows = [[r.name, r.backend, *(_cell(r.config.get(k, "")) for k in keys), len(r.requests),
             str(r.path)] for r in runs]
    backends = sorted({r.backend for r in runs})
    slo_text = (", ".join(f"{k} &le; {v:g} ms" for k, v in slos_ms.items()) if slos_ms
                else "none given (goodput from each run's summary, where it has one)")
    return "\n".join([
        f'<p class="meta">{len(runs)} run(s) compared; backends: {html.escape(", ".join(backends))}.'
        f" Goodput SLOs: {slo_text}.</p>",
        _table_html(head, rows), roofline_note(runs)])


def roofline_note(runs: list[Run]) -> str:
    """Names the runs whose step times rest on a roofline only, with how far rooflines fell
    short where measured (their config's ``roofline_gap``); empty when none does."""
    gapped = [r for r in runs if r.config.get("roofline_gap")]
    if not gapped:
        return ""
    names = ", ".join(r.name for r in gapped)
    text = str(gapped[0].config["roofline_gap"])
    return f'<p class="note">{html.escape(names)}: {html.escape(text)}</p>'


def summary_html(table: pd.DataFrame) -> str:
    """The summary table turned on its side: one row per metric, one column per run."""
    columns = [c for c in table.columns if c not in ("run", "folder")]
    rows = [[c, *(_cell(v) for v in table[c])] for c in columns]
    return _table_html(["metric", *table["run"].astype(str)], rows)


def config_html(runs: list[Run]) -> str:
    """The engine settings (from each run's config.json) that are not the same in every run."""
    diff = config_differences(runs)
    if diff.empty:
        return '<p class="note">Every run has the same engine configuration.</p>'
    rows = [[row["key"], *(_cell(row[r.name]) for r in runs)] for _, row in diff.iterrows()]
    return _table_html(["key", *(r.name for r in runs)], rows)


def errors_html(errors: pd.DataFrame) -> str:
    head = ["simulator run", "real run", "metric", "sim", "real", "relative error"]
    rows = [[e.sim_run, e.real_run, e.metric, _cell(e.sim), _cell(e.real), _percent(e.rel_error)]
            for e in errors.itertuples()]
    return _table_html(head, rows)


def section_html(k: int, name: str, fig: go.Figure | None, note: str) -> str:
    if fig is None:
        return f"<h2>{html.escape(name)}</h2>\n<p class=\"note\">Skipped: {html.escape(note)}</p>"
    height = fig.layout.height or 500
    div = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"figure-{k}",
                      default_height=f"{height}px", config={"displaylogo": False})
    return f"<h2>{html.escape(name)}</h2>\n{div}"


def _table_html(head: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f'<th class="{"key" if i == 0 else ""}">{html.escape(str(h))}</th>'
                 for i, h in enumerate(head))
    body = "\n".join(
        "<tr>" + "".join(f'<td class="{"key" if i == 0 else ""}">{html.escape(str(v))}</td>'
                         for i, v in enumerate(row)) + "</tr>" for row in rows)
    table = f"<table><thead><tr>{th}</tr></thead>\n<tbody>{body}</tbody></table>"
    return f'<div class="scroll">{table}</div>'


def _cell(value: Any) -> str:
    """Numbers to four significant digits (integers whole), NaN and None as a dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)) and float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.1%}"
