"""The host's speed during real replays, against a profile's (docs/fidelity-api.md, "Speed").

Each replay is bracketed by the host-speed probe (``gpu.measurement.profiler.speed_probe``,
written beside the run as ``speed_probe.json``); a profile's fit records the same probe at its
calibration. Their ratio is the host's drift since; the replays' own steps against the profile's
time for them (``simulator.calibration.run_speed``) give it too, read from the replay itself.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinserve.core.step_sample import StepSample
    from twinserve.simulator.hardware import FittedParams

SPEED_PROBE_FILE = "speed_probe.json"
HOST_SPEED_METRIC = "host_speed_vs_profile"
REPLAY_SPEED_METRIC = "replay_speed_vs_profile"
SPEEDS = ("host", "replay")


def write_speed_probe(path: Path, before: dict[str, float], after: dict[str, float]) -> None:
    """The probe's step times before and after a replay, beside the run it brackets."""
    path.write_text(json.dumps({"before": before, "after": after}, indent=1) + "\n")


def profile_fit(profile: str | Path, model: str,
                tensor_parallel_size: int = 1) -> FittedParams | None:
    """The profile's fit for ``model`` at ``tensor_parallel_size`` (None: it holds none)."""
    from twinserve.simulator.hardware import load_hardware
    from twinserve.simulator.model_spec import load_model_spec
    return load_hardware(profile).find_fitted(load_model_spec(model).name, tensor_parallel_size)


def host_speeds(real_dirs: list[Path], fit: FittedParams | None) -> list[float]:
    """Per real run that recorded a speed probe: its steps' time over their time at the
    calibration of ``fit`` (``FittedParams.host_speed`` of the mean of before and after); empty
    when no run has a probe or there is no fit holding one."""
    if fit is None or not fit.speed_probe:
        return []
    speeds = []
    for d in real_dirs:
        if (d / SPEED_PROBE_FILE).is_file():
            data = json.loads((d / SPEED_PROBE_FILE).read_text())
            before, after = data["before"], data["after"]
            speeds.append(fit.host_speed({k: (before[k] + after[k]) / 2 for k in before}))
    return speeds


def replay_speeds(runs: list[list[StepSample]], fit: FittedParams | None) -> list[float]:
    """Per real run (its recorded steps): their measured time over ``fit``'s time for the same
    steps (``calibration.run_speed``); empty without a fit."""
    from twinserve.simulator.calibration import run_speed
    if fit is None:
        return []
    return [v for v in (run_speed(fit, steps) for steps in runs) if math.isfinite(v)]


_NO_SPEED = {
    "host": "--at-host-speed needs real runs with a speed probe (replayed by this version of "
            "validate) and a profile whose fit holds one (calibrated by this version).",
    "replay": "--at-replay-speed needs a profile with a fit for the model and real runs that "
              "recorded their steps (step_features.csv).",
}


def at_speed(profile: str | Path, speeds: list[float], which: str, out: Path) -> Path:
    """``profile`` scaled to the median of the replays' ``which`` speeds (``host``: by their
    probe; ``replay``: by their own steps), written to ``out``."""
    from twinserve.simulator.hardware import load_hardware
    if which not in SPEEDS:
        raise ValueError(f"at_speed: which must be one of {', '.join(SPEEDS)}, got {which!r}.")
    if not speeds:
        raise ValueError(_NO_SPEED[which])
    return load_hardware(profile).at_host_speed(statistics.median(speeds)).save(out)
