"""A fidelity study: one profile, several held-out workloads replayed in interleaved rounds, the
twin judged against each workload's replays (docs/fidelity-api.md, "Study").

1. One profile (``calibrate``'s defaults at the study's engine limits, no workload used to fit
   it), its level measured in rounds: the grid timed again before each round, the engine loop's
   workloads split between the round's replays (``InterleavedCalibration``, ``loop_schedule``).
2. Each workload replayed once per round, the rounds in alternating order (``round_order``), on
   the calibration's weights.
3. Each workload's twin against its replays (``validate`` with ``reuse_real``), as calibrated and
   at the replays' own speed; ``study_table.study_rows`` gathers the table.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinserve.fidelity.backend import Log, load_runner, with_model
from twinserve.fidelity.interleaved import InterleavedCalibration, loop_schedule
from twinserve.fidelity.replays import replay
from twinserve.fidelity.settings import CalibrationSettings
from twinserve.fidelity.study_table import study_rows
from twinserve.fidelity.threads import set_threads
from twinserve.fidelity.validation import ValidateSettings, validate
from twinserve.fidelity.workload import TraceSpec

if TYPE_CHECKING:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.worker.model_runner import ModelRunner


@dataclass(slots=True, frozen=True)
class StudyWorkload:
    """One held-out workload: its ``trace``, and the engine arguments it changes from the
    study's (``engine``: e.g. the policy, a small KV cache); its model length is the trace's."""

    name: str
    what: str
    trace: TraceSpec
    engine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"StudyWorkload.name must be a non-empty folder name, got "
                             f"{self.name!r}.")

    def engine_args(self, study: EngineArgs) -> EngineArgs:
        """The study's engine with this workload's changes."""
        changes = dict(self.engine)
        if self.trace.max_model_len is not None:
            changes.setdefault("max_model_len", self.trace.max_model_len)
        return study.replace(**changes)


@dataclass(slots=True, frozen=True)
class StudySettings:
    """``rounds``: replays per workload; ``profile``: use it instead of calibrating;
    ``calibration_model_len``: the calibration's model length (the workloads' longest);
    ``resume``: keep replays and profile found in the output folder."""

    rounds: int = 3
    profile: str | None = None
    calibration_model_len: int = 512
    resume: bool = False
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}.")
        if self.calibration_model_len < 1:
            raise ValueError(f"calibration_model_len must be >= 1, got "
                             f"{self.calibration_model_len}.")


def round_order(names: Sequence[str], round_: int) -> list[str]:
    """The workloads in the order round ``round_`` (from 1) replays them: as given, and reversed
    every other round, so that no workload always comes first after the level (or last)."""
    return list(names) if round_ % 2 else list(reversed(names))


def run_study(engine: EngineArgs, workloads: Sequence[StudyWorkload], out: str | Path,
              settings: StudySettings | None = None,
              log: Log | None = None) -> list[dict[str, object]]:
    """The study's rows (``study_table.study_rows``), also written to
    ``out/fidelity_study.csv``; replays under ``out/real/<workload>-<round>``."""
    settings = settings or StudySettings()
    if not workloads:
        raise ValueError("workloads: give at least one workload.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = log or (lambda msg: None)
    engine = with_model(engine)
    set_threads(settings.calibration.num_threads)  # the replays' too, with a given profile
    profile = Path(settings.profile) if settings.profile else out / "profile.json"
    cal = None
    if not settings.profile and not (settings.resume and profile.is_file()):
        cal = _calibration(engine.replace(max_model_len=settings.calibration_model_len),
                           settings.calibration, log)
    runs = _replay_rounds(engine, workloads, out, settings, cal, log)
    if cal is not None:
        cal.save(profile, f"Calibrated by the fidelity study: the grid first and again before "
                 f"each of its {settings.rounds} rounds of replays, the engine loop's workloads "
                 "split between each round's replays.")
        del cal  # (its model load)
    rows: list[dict[str, object]] = []
    for w in workloads:
        rows += _judge(engine, w, runs[w.name], profile, out)
    with open(out / "fidelity_study.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return rows


def _replay_rounds(engine: EngineArgs, workloads: Sequence[StudyWorkload], out: Path,
                   settings: StudySettings, cal: InterleavedCalibration | None,
                   log: Log) -> dict[str, list[Path]]:
    """Every workload replayed once per round, the engine loop's parts between the replays."""
    by_name = {w.name: w for w in workloads}
    runs: dict[str, list[Path]] = {w.name: [] for w in workloads}
    for round_ in range(1, settings.rounds + 1):
        order = round_order(list(by_name), round_)
        loop_parts: list[list[int]] = [[] for _ in order]
        if cal is not None:
            cal.time_grid_pass()
            loop_parts = loop_schedule(cal.num_loop_parts(), len(order), round_)
        for name, parts in zip(order, loop_parts, strict=True):
            if cal is not None and parts:
                cal.measure_loop(parts)
            folder = out / "real" / f"{name}-{round_}"
            if not (settings.resume and (folder / "real" / "summary.json").is_file()):
                _replay_once(engine, by_name[name], folder, cal.runner if cal else None, log)
            runs[name].append(folder / "real")
    return runs


def _replay_once(engine: EngineArgs, workload: StudyWorkload, folder: Path,
                 weights_from: ModelRunner | None, log: Log) -> None:
    """One replay of ``workload`` into ``folder/real``, on ``weights_from``'s weights (the
    calibration's load: two loads of one model run the same steps a few % apart), else on a
    load of its own."""
    w_engine = workload.engine_args(engine)
    runner = load_runner(w_engine, weights_from)
    replay(w_engine, workload.trace.load(), folder, 1, runner, log=log)


def _judge(engine: EngineArgs, workload: StudyWorkload, runs: list[Path], profile: Path,
           out: Path) -> list[dict[str, object]]:
    """The workload's twin against its replays, as calibrated and at the replays' speed."""
    w_engine, requests = workload.engine_args(engine), workload.trace.load()
    reuse = ValidateSettings(str(profile), tuple(runs), len(runs))
    validate(w_engine, requests, out / workload.name, reuse)
    at_replay = ValidateSettings(str(profile), tuple(runs), len(runs), at_speed="replay")
    validate(w_engine, requests, out / f"{workload.name}-at-replay-speed", at_replay)
    return study_rows(workload.name, out / workload.name / "errors.csv", runs,
                      out / f"{workload.name}-at-replay-speed" / "errors.csv")


def _calibration(engine: EngineArgs, settings: CalibrationSettings,
                 log: Log) -> InterleavedCalibration:
    """``calibrate``'s defaults at the study's engine limits on a model load of its own: the
    grid now, the engine loop (the profile's level) split between each round's replays."""
    cal = InterleavedCalibration(settings, engine, load_runner(engine), log)
    cal.measure_grid()
    return cal
