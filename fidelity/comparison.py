"""Comparing a twin with real replays: the error table (docs/fidelity-api.md, "Compare").

Each metric of the twin is judged against the median of the real replays, their spread beside
it (``reports.fidelity``: a miss inside a wider spread is marked ``~``); from three replays on,
each replay left out in turn and judged against the others as the twin is tells how often the
real engine itself passes (``reports.repeatability``): the host's floor under the twin's error.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twinserve.fidelity.speeds import (
    HOST_SPEED_METRIC,
    REPLAY_SPEED_METRIC,
    host_speeds,
    profile_fit,
    replay_speeds,
)
from twinserve.reports.repeatability import Repeatability


@dataclass(slots=True, frozen=True)
class ErrorTable:
    """The error rows (``reports.fidelity``'s columns, one per metric), the leave-one-out
    ``repeatability`` counts (empty below three replays) and the table's ``title``."""

    rows: tuple[dict[str, Any], ...]
    repeatability: tuple[Repeatability, ...] = ()
    title: str = "sim vs real"
    speeds: dict[str, list[float]] = field(default_factory=dict)  # host / replay, per replay

    def row(self, metric: str) -> dict[str, Any]:
        """The row of ``metric`` (KeyError naming the metrics there are)."""
        for r in self.rows:
            if r["metric"] == metric:
                return r
        raise KeyError(f"no row {metric!r}; rows: {', '.join(r['metric'] for r in self.rows)}")

    def format(self) -> str:
        """The table as ``validate`` prints it, the repeatability line under it."""
        from twinserve.reports.fidelity import format_errors
        from twinserve.reports.repeatability import format_repeatability
        text = format_errors(list(self.rows), self.title)
        if self.repeatability:
            text += "\n  " + format_repeatability(list(self.repeatability))
        return text

    def write(self, out: str | Path) -> Path:
        """``out/errors.csv`` and, with repeatability counts, ``out/repeatability.csv``."""
        from twinserve.reports.fidelity import write_errors
        from twinserve.reports.repeatability import write_repeatability
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "repeatability.csv").unlink(missing_ok=True)
        if self.repeatability:
            write_repeatability(out / "repeatability.csv", list(self.repeatability))
        return write_errors(out / "errors.csv", list(self.rows))


def compare(twin: str | Path, real_runs: Sequence[str | Path], profile: str | Path,
            model: str | None = None, speed_profile: str | Path | None = None,
            title: str | None = None) -> ErrorTable:
    """The twin's run folder ``twin`` against the real run folders ``real_runs`` (the twin
    simulated on ``profile``): every summary metric, the host's and the replays' speed against
    ``speed_profile`` (default ``profile``; the profile before rescaling, where the twin ran on
    a rescaled one), the replayed steps' measured time against the profile's, per tenant TTFT."""
    from twinserve.core.step_sample import read_recorded_samples
    from twinserve.reports.fidelity import error_row, error_rows, step_time_row, tenant_ttft_rows
    from twinserve.reports.repeatability import repeatability
    from twinserve.simulator.calibration import predicted_seconds
    reals = [Path(d) for d in real_runs]
    if not reals:
        raise ValueError("real_runs: give at least one real run folder.")
    config = json.loads((reals[0] / "config.json").read_text())
    model = model or str(config["model"])
    summaries = [json.loads((d / "summary.json").read_text()) for d in reals]
    sim = json.loads((Path(twin) / "summary.json").read_text())
    tp = int(config.get("tensor_parallel_size", 1))
    runs = [read_recorded_samples([d]) for d in reals]  # each replay's steps
    fit = profile_fit(speed_profile or profile, model, tp)
    speeds = {"host": host_speeds(reals, fit), "replay": replay_speeds(runs, fit)}
    rows = error_rows(summaries, sim)
    for metric, which in ((HOST_SPEED_METRIC, "host"), (REPLAY_SPEED_METRIC, "replay")):
        if speeds[which]:  # the host's speed alone moves the step times by this much
            rows.append(error_row(metric, speeds[which], 1.0))
    samples = [s for steps in runs for s in steps]
    predicted = predicted_seconds(samples, model, profile, int(config["block_size"]), tp)
    rows.append(step_time_row(sum(s.seconds for s in samples), predicted,
                              len(reals) if samples else 0))
    rows += tenant_ttft_rows(reals, Path(twin))
    title = title or (f"sim vs real ({config['scheduling_policy']}, {len(reals)} real run(s), "
                      f"profile {profile})")
    return ErrorTable(tuple(rows), tuple(repeatability(summaries, sim)), title, speeds)
