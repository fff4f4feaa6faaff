"""Two stories that must not share an axis: policies compared in simulation, and the twin judged
against the real engine. Each gets a page of its own, and an index links them:

- ``policies.html``: simulated runs of one workload under several policies (one simulated GPU).
- ``twin-vs-real.html``: the real engine's replays of another workload against its twin(s),
  judged as ``twinserve validate`` judges them (``reports.fidelity``: each metric's error against
  the median of the replays, ``ok`` within its target, ``~`` within the replays' spread, ``MISS``
  outside both; ``reports.repeatability``: how often a replay itself passed against the others).
- ``report.html`` (the ``out`` path): the index, with each story's headline.

Runs are named by their role, whatever their folders' labels: ``sim <hardware> <policy>``,
``real <device> <policy> #<i>``, ``twin <device> <policy>`` (plus the twin's note), so the
simulated GPU's runs can never be taken for the twin of the real one.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from twinserve.reports import figures
from twinserve.reports.fidelity import (
    error_rows,
    host_check,
    spread_pct,
    tenant_ttft_rows,
    verdict,
)
from twinserve.reports.html import (
    SECTIONS,
    _cell,
    _table_html,
    config_html,
    header_html,
    render_page,
    roofline_note,
    summary_html,
    write_runs_page,
)
from twinserve.reports.repeatability import format_repeatability, repeatability
from twinserve.reports.runs import Run, load_run
from twinserve.reports.tables import summary_table, write_table

POLICIES_PAGE = "policies.html"
TWIN_PAGE = "twin-vs-real.html"
# the figures of both pages: one workload at one rate each (no load sweep), and the twin's
# comparison is the twin page's own (against the replays' median, not one replay)
SECTIONS_SHOWN = tuple(s for s in SECTIONS if s[0] not in ("Simulation against reality",
                                                           "Load sweep"))
HEADLINE_METRICS = ("request_throughput", "mean_ttft_ms", "prio0_mean_ttft_ms",
                    "prio1_mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "jain_index")
VERDICTS = ("ok", "~", "MISS")


@dataclass(slots=True, frozen=True)
class TwinRun:
    """One twin of the real replays: its run folder and what sets it apart, shown in its name
    (e.g. "at the replays' speed"; "" for the plain twin)."""

    path: Path
    note: str = ""


@dataclass(slots=True, frozen=True)
class JudgedTwin:
    """A twin and its error rows against the real replays (``fidelity.error_rows``, then the
    per-tenant TTFT rows), each with its verdict."""

    run: Run
    rows: list[dict[str, Any]]

    @property
    def verdicts(self) -> dict[str, int]:
        marks = [row["verdict"] for row in self.rows if row["verdict"]]
        return {v: marks.count(v) for v in VERDICTS}

    def headline(self) -> str:
        counts = self.verdicts
        return (f"{self.run.name}: {counts['ok']} of {sum(counts.values())} targeted metrics "
                f"within target, {counts['~']} within the replays' spread, {counts['MISS']} missed")


@dataclass(slots=True, frozen=True)
class StoryPages:
    """What ``write_story_pages`` wrote: the index, the pages (None when a story was not told)
    and the twins as judged."""

    index: Path
    policies: Path | None
    twin: Path | None
    judged: tuple[JudgedTwin, ...]


def write_story_pages(out: Path | str, policy_runs: Sequence[Path], real_runs: Sequence[Path],
                      twin_runs: Sequence[TwinRun], slos_ms: dict[str, float] | None = None,
                      title: str = "twinserve demo") -> StoryPages:
    """Writes the index ``out`` and, beside it, the policy page (when ``policy_runs``) and the
    twin page (when ``real_runs``)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    policies = [_named(p, "sim", "policy_runs") for p in policy_runs]
    reals, twins = _real_and_twins(real_runs, twin_runs)
    if not policies and not reals:
        raise ValueError("policy_runs and real_runs are both empty: nothing to report.")
    index = ['<p class="meta">Two stories, each on a page of its own (they share no table and '
             'no axis): the policies compared in simulation, and the twin judged against the '
             'real engine.</p>']
    policy_page = twin_page = None
    if policies:
        policy_page = write_runs_page(policies, out.parent / POLICIES_PAGE, slos_ms,
                                      f"{title}: policies in simulation",
                                      sections=SECTIONS_SHOWN, intro=_back_link(out))
        index.append(_policies_summary(policies))
    judged = [judge(reals, twin) for twin in twins]
    if reals:
        twin_page = write_twin_page(out.parent / TWIN_PAGE, reals, judged, slos_ms,
                                    f"{title}: the twin against the real engine", _back_link(out))
        index.append(_twin_summary(reals, judged))
    out.write_text(render_page(title, index, []), encoding="utf-8")
    return StoryPages(out, policy_page, twin_page, tuple(judged))


def judge(reals: list[Run], twin: Run) -> JudgedTwin:
    """``twin`` against the real replays as ``validate`` judges it."""
    rows = error_rows([r.summary for r in reals], twin.summary)
    rows += tenant_ttft_rows([r.path for r in reals], twin.path)
    for row in rows:
        target = None if row["target_pct"] == "" else float(row["target_pct"])
        spread = spread_pct(row) if row["real_runs"] > 1 else float("nan")
        row["verdict"] = verdict(row["rel_error_pct"], target, spread)
    return JudgedTwin(twin, rows)


def write_twin_page(out: Path, reals: list[Run], judged: list[JudgedTwin],
                    slos_ms: dict[str, float] | None, title: str, intro: str) -> Path:
    """The twin page: the judgement, the replays' repeatability, then the runs' own tables and
    figures (the real replays and the twins only). Writes ``<stem>.csv`` (summary) and
    ``<stem>_errors.csv`` (the judged rows, one ``twin`` column) beside it."""
    runs = [*reals, *(j.run for j in judged)]
    table = summary_table(runs, slos_ms)
    write_table(table, out.parent / out.stem)
    errors = pd.DataFrame([{"twin": j.run.name, **row} for j in judged for row in j.rows])
    errors.to_csv(out.parent / f"{out.stem}_errors.csv", index=False)
    body = [intro, header_html(runs, slos_ms), "<h2>The twin against the real replays</h2>",
            judgement_html(reals, judged), "<h2>Summary</h2>", summary_html(table),
            "<h2>Engine configuration: what differs</h2>", config_html(runs)]
    built = [("Twin error against the real median", figures.twin_errors(
        [(j.run.name, j.rows) for j in judged]), "no twin to judge.")]
    built += [(name, builder(runs, None), note) for name, builder, note in SECTIONS_SHOWN]
    out.write_text(render_page(title, body, built), encoding="utf-8")
    return out


def judgement_html(reals: list[Run], judged: list[JudgedTwin]) -> str:
    """One row per metric: its target, the replays' median and spread, each twin's value, error
    and verdict; under it the host check and each twin's repeatability line."""
    first = judged[0].rows if judged else []
    head = ["metric", "target", "real median", "real min..max", "real spread"]
    for j in judged:
        head += [j.run.name, "error", "verdict"]
    rows = []
    for k, row in enumerate(first):
        cells = [row["metric"], f"±{row['target_pct']:g}%" if row["target_pct"] != "" else "",
                 _cell(row["real"]), f"{_cell(row['real_min'])}..{_cell(row['real_max'])}",
                 _pct(spread_pct(row))]
        for j in judged:
            mine = j.rows[k]
            cells += [_cell(mine["sim"]), _pct(mine["rel_error_pct"], signed=True), mine["verdict"]]
        rows.append(cells)
    notes = [f"{len(reals)} real replay(s); the twin is judged against their median, as "
             "<code>twinserve validate</code> judges it: <b>ok</b> within the target, "
             "<b>~</b> within the replays' own spread (half their range) where that is larger, "
             "<b>MISS</b> outside both."]
    targeted = [row for row in first if row["target_pct"] != "" and row["real_runs"] > 1]
    if targeted:
        notes.append(host_check([(spread_pct(r), float(r["target_pct"])) for r in targeted]))
    notes += _verdict_lines(reals, judged)
    return _table_html(head, rows) + "".join(
        f'<p class="meta">{n if k == 0 else html.escape(n)}</p>' for k, n in enumerate(notes))


def _verdict_lines(reals: list[Run], judged: list[JudgedTwin]) -> list[str]:
    """Each twin's verdict counts, then each one's leave-one-out repeatability line (from 3
    replays on: ``repeatability.format_repeatability``)."""
    lines = [j.headline() for j in judged]
    return lines + [line for j in judged if (line := format_repeatability(
        repeatability([r.summary for r in reals], j.run.summary), j.run.name))]


def _pct(value: float, signed: bool = False) -> str:
    if value != value:  # nan
        return "-"
    return f"{value:+.1f}%" if signed else f"{value:.1f}%"


def _real_and_twins(real_runs: Sequence[Path], twin_runs: Sequence[TwinRun]) -> tuple[
        list[Run], list[Run]]:
    if bool(real_runs) != bool(twin_runs):
        raise ValueError("real_runs and twin_runs go together: give both or neither.")
    reals = [_named(p, "real", "real_runs") for p in real_runs]
    devices = sorted({str(r.config.get("device_type", r.backend)) for r in reals})
    policies = sorted({_policy(r.config) for r in reals})
    if len(policies) > 1:
        raise ValueError(f"real_runs must replay one policy, got {policies}.")
    reals = [_renamed(r, f"real {'/'.join(devices)} {policies[0]} #{i}")
             for i, r in enumerate(reals, start=1)]
    twins = []
    for twin in twin_runs:
        run = _named(twin.path, "sim", "twin_runs")
        name = f"twin {'/'.join(devices)} {_policy(run.config)}"
        twins.append(_renamed(run, f"{name} ({twin.note})" if twin.note else name))
    return reals, twins


def _named(path: Path, role: str, field: str) -> Run:
    """The run at ``path``; a policy run named ``sim <hardware> <policy>``. ``role`` ``sim``:
    it must be a simulator run, ``real``: any other backend (``field`` named when not)."""
    run = load_run(path)
    if run.is_sim != (role == "sim"):
        want = "a simulator run (backend sim)" if role == "sim" else "a real run (not backend sim)"
        raise ValueError(f"{field}: {path} is not {want}; its backend is {run.backend!r}.")
    if field != "policy_runs":
        return run
    hardware = Path(str(run.config.get("hardware", "gpu"))).stem
    return _renamed(run, f"sim {hardware} {_policy(run.config)}")


def _policy(config: dict[str, Any]) -> str:
    return str(config.get("scheduling_policy") or config.get("policy") or "?")


def _renamed(run: Run, name: str) -> Run:
    return Run(run.path, name, run.config, run.summary, run.requests, run.steps, run.tenants)


def _back_link(index: Path) -> str:
    return (f'<p class="meta"><a href="{html.escape(index.name)}">&larr; index</a> | '
            f'<a href="{POLICIES_PAGE}">policies in simulation</a> | '
            f'<a href="{TWIN_PAGE}">the twin against the real engine</a></p>')


def _policies_summary(runs: list[Run]) -> str:
    table = summary_table(runs)
    rows = [[metric, *(_cell(v) for v in table[metric])] for metric in HEADLINE_METRICS
            if metric in table.columns]
    cost = sorted({str(r.config.get("cost_model", "")) for r in runs} - {""})
    where = f"<p class=\"meta\">Step times: {html.escape('; '.join(cost))}</p>" if cost else ""
    return "\n".join([
        f'<h2><a href="{POLICIES_PAGE}">Policies in simulation</a></h2>',
        f'<p class="meta">{len(runs)} simulated run(s) of one workload: '
        f'{html.escape(", ".join(r.name for r in runs))}.</p>',
        _table_html(["metric", *(r.name for r in runs)], rows), where, roofline_note(runs)])


def _twin_summary(reals: list[Run], judged: list[JudgedTwin]) -> str:
    lines = _verdict_lines(reals, judged)
    return "\n".join([
        f'<h2><a href="{TWIN_PAGE}">The twin against the real engine</a></h2>',
        f'<p class="meta">{len(reals)} real replay(s) of one workload '
        f'({html.escape(", ".join(r.name for r in reals))}) against their twin(s), judged '
        "against the replays' median and spread.</p>",
        *(f'<p class="meta">{html.escape(line)}</p>' for line in lines)])
