"""A backend calibration whose level is measured in rounds, between the runs it is compared with.

The grid of micro-benchmarks sets the profile's shape; the engine-loop workloads (synthetic,
no trace) set its level. On a host whose speed drifts over minutes, a level measured before the
real runs carries that drift into every prediction, so ``validate`` runs the engine loop before
each real replay, and the fidelity study splits its workloads between the replays of each round
(``loop_schedule``), and both fit on all of them: the level is the host's over the same minutes
as the runs, as interleaved benchmark rounds are. Each round also times the grid once more, so
each grid step's median spans the same minutes. ``twinserve calibrate`` is the one-round case.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from twinserve.fidelity.backend import Log, base_hardware_for, measure_interconnect
from twinserve.fidelity.settings import CalibrationSettings
from twinserve.fidelity.step_space import StepSpace

if TYPE_CHECKING:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.measurement.profiler import BackendMeasurement
    from twinserve.gpu.worker.model_runner import ModelRunner
    from twinserve.simulator.calibration import Calibration


@dataclass(slots=True)
class InterleavedCalibration:
    """``measure_grid`` once, ``measure_level`` before each round (or ``time_grid_pass`` and
    the engine loop split between its runs by ``measure_loop``), then ``fit`` or ``save``
    (one round: ``twinserve calibrate``'s measurement). ``space``: the part of the step space
    timed (``None``: the engine's limits)."""

    settings: CalibrationSettings
    engine_args: EngineArgs
    runner: ModelRunner
    log: Log
    space: StepSpace | None = None
    measured: BackendMeasurement | None = None
    grid_probe: dict[str, float] = field(default_factory=dict)  # the probe before the grid
    probes: list[dict[str, float]] = field(default_factory=list)  # one per measure_loop
    # under PP on a CPU, the shared-stage slowdown read before each round (fidelity.calibration)
    stage_slowdowns: list[float] = field(default_factory=list)

    def measure_grid(self) -> None:
        """The micro-benchmarks and swap copies; without the engine loop (``--no-engine-loop``)
        the grid sets the level too, and its probe is the mean of the probe before and after."""
        from twinserve.gpu.measurement.profiler import measure_backend, speed_probe
        s = self.settings
        self.grid_probe = speed_probe(self.runner)
        self.measured = measure_backend(self.runner, self.engine_args, s.quick, s.warmup,
                                        s.repeats, engine_loop=False, log=self.log,
                                        space=self._space())
        if not s.engine_loop:
            after = self._probe_after()
            self.probes = [{k: (v + after[k]) / 2 for k, v in self.grid_probe.items()}]

    def measure_level(self) -> dict[str, float]:
        """One round: ``time_grid_pass`` then every engine-loop workload (``measure_loop``);
        returns the host-speed probe right after, the probe the round's runs start from (the
        grid's alone without the engine loop)."""
        from twinserve.fidelity.calibration import measure_stage_slowdown
        from twinserve.gpu.measurement.profiler import speed_probe
        slowdown = measure_stage_slowdown(self.runner, self.log)
        if slowdown is not None:
            self.stage_slowdowns.append(slowdown)
        if not self.settings.engine_loop:
            return speed_probe(self.runner)
        self.time_grid_pass()
        return self.measure_loop()

    def time_grid_pass(self) -> None:
        """Another timed pass of the grid, whose medians then span the rounds (on a drifting
        host one measurement of the grid bent the profile's shape: a 96-token prefill took
        130 ms in one grid, 109 ms in another)."""
        measured = self._measured()
        grid = measured.grid
        if grid is not None and grid.steps:
            grid.time_pass()
            measured.micro = grid.samples()
            self.log(f"micro-benchmarks: pass {len(grid.times[0])} of {len(grid.steps)} steps "
                     "timed (the grid's medians now span the rounds)")

    def num_loop_parts(self) -> int:
        """How many engine-loop workloads ``measure_loop`` can run one by one."""
        from twinserve.gpu.engine.engine_loop import runner_scenarios
        return len(runner_scenarios(self.runner, self.settings.quick, self._space()))

    def measure_loop(self, parts: Sequence[int] | None = None) -> dict[str, float]:
        """The engine-loop workloads (those at the indices ``parts``, else all), then the
        host-speed probe, which ``fit`` averages into the speed the level stands for. Split
        between the runs of a round (``loop_schedule``), the level samples the same minutes as
        the runs, not only their start."""
        from twinserve.gpu.engine.engine_loop import measure_engine_loop
        self._measured().loop += measure_engine_loop(self.runner, self.engine_args,
                                                     self.settings.quick, self.log, parts,
                                                     self._space())
        probe = self._probe_after()
        self.probes.append(probe)
        return probe

    def _space(self) -> tuple[int, int, int] | None:
        return None if self.space is None else self.space.as_tuple()

    def _measured(self) -> BackendMeasurement:
        if self.measured is None:
            raise RuntimeError("measure_grid first")
        return self.measured

    def _probe_after(self) -> dict[str, float]:
        from twinserve.gpu.measurement.profiler import speed_probe
        probe = speed_probe(self.runner)
        before = self.grid_probe
        self.log(f"host-speed probe: {len(probe)} steps, after the measurement "
                 f"{statistics.median(probe[k] / before[k] for k in before):.3f}x their time "
                 "before")
        return probe

    def fit(self, model_name: str) -> Calibration:
        """``simulator.calibration.fit_backend`` of the grid and every engine-loop measurement,
        with the mean of the probes after them (the speed its level stands for)."""
        from twinserve.simulator.calibration import fit_backend
        m = self.measured
        if m is None or not self.probes:
            raise RuntimeError("measure_grid and at least one measure_level or measure_loop first")
        cal = fit_backend(m.micro, m.loop, model_name, m.seconds_per_swap_block, m.lora,
                          self.engine_args.tensor_parallel_size)
        probe = {k: statistics.fmean(p[k] for p in self.probes) for k in self.probes[0]}
        cal.params = dataclasses.replace(cal.params, speed_probe=probe)
        return cal

    def save(self, path: Path, note: str) -> Path:
        """The fit as a profile at ``path``, its source naming the rounds; the samples it was
        fitted on beside it (``samples_path``: ``calibrate --from-run ... --backend-samples``
        and ``simulator.calibration.split_backend_samples`` read them back)."""
        from twinserve.core.step_sample import write_samples
        from twinserve.fidelity.calibration import with_stage_slowdown
        from twinserve.gpu.worker.platform import current_platform
        from twinserve.simulator.calibration import save_profile
        from twinserve.simulator.model_spec import load_model_spec
        model = str(self.engine_args.model)
        cal = self.fit(self.settings.profile_model or load_model_spec(model).name)
        platform = current_platform(self.runner.device)
        parts = len(self.probes) if self.settings.engine_loop else 0
        cal.params = dataclasses.replace(cal.params, source=(
            f"twinserve calibrate on {platform.device_name} ({len(cal.samples)} steps), the "
            f"engine loop in {parts} part(s) between the real runs"))
        base = self.settings.base_hardware or base_hardware_for(self.engine_args.device)
        out = save_profile(cal, model, base, path, self.engine_args.block_size, note,
                           platform, measure_interconnect(self.runner, self.engine_args, self.log),
                           self.engine_args.kernel_settings())
        write_samples(samples_path(out), cal.samples)
        self.log(cal.report)
        return with_stage_slowdown(out, self.stage_slowdowns)


def loop_schedule(num_parts: int, num_runs: int, round_: int) -> list[list[int]]:
    """Which engine-loop parts (``InterleavedCalibration.measure_loop``) run before each of a
    round's ``num_runs`` runs, in round ``round_`` (from 1): every part once, spread evenly
    over the round, the whole pattern shifted from round to round so that each part (the
    longest sets most of the level) lands at another place in each. Measured only before the
    round's first run, the level had followed that run's speed (within 1% in three studies)
    and missed the round's later minutes, up to 10% slower or faster."""
    if num_parts < 1 or num_runs < 1 or round_ < 1:
        raise ValueError(f"loop_schedule needs num_parts, num_runs and round_ >= 1, got "
                         f"{num_parts}, {num_runs}, {round_}.")
    # a golden-ratio step: the rounds' shifts stay apart for any number of rounds
    shift = int((round_ - 1) * 0.618034 % 1 * num_runs)
    schedule: list[list[int]] = [[] for _ in range(num_runs)]
    for part in range(num_parts):
        schedule[(part * num_runs // num_parts + shift) % num_runs].append(part)
    return schedule


def samples_path(profile: Path) -> Path:
    """Where ``InterleavedCalibration.save`` writes the samples of the profile at ``profile``."""
    return profile.with_name(f"{profile.stem}_samples.csv")
