"""A backend calibration whose level is measured in rounds, between the runs it is compared with.

The grid of micro-benchmarks sets the profile's shape; the engine-loop workloads (synthetic,
no trace) set its level. On a host whose speed drifts over minutes, a level measured before the
real runs carries that drift into every prediction, so ``validate`` and the fidelity study run
the engine loop before each real replay (or each round of them) and fit on all of them: the
level is the host's over the same minutes as the runs, as interleaved benchmark rounds are. Each
round also times the grid once more, so each grid step's median spans the same minutes.
``twinserve calibrate`` is the one-round case.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from twinserve.entrypoints.calibrate import Log, base_hardware_for, measure_interconnect

if TYPE_CHECKING:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.model_runner import ModelRunner
    from twinserve.gpu.profiler import BackendMeasurement
    from twinserve.simulator.calibration import Calibration


@dataclass(slots=True)
class InterleavedCalibration:
    """``measure_grid`` once, ``measure_level`` before each round, then ``fit`` or ``save``
    (one round: ``twinserve calibrate``'s measurement). ``args``: the calibration flags
    (``add_calibration_flags``) and ``--model``."""

    args: argparse.Namespace
    engine_args: EngineArgs
    runner: ModelRunner
    log: Log
    measured: BackendMeasurement | None = None
    grid_probe: dict[str, float] = field(default_factory=dict)  # the probe before the grid
    probes: list[dict[str, float]] = field(default_factory=list)  # one per round

    def measure_grid(self) -> None:
        """The micro-benchmarks and swap copies; without the engine loop (``--no-engine-loop``)
        the grid sets the level too, and its probe is the mean of the probe before and after."""
        from twinserve.gpu.profiler import measure_backend, speed_probe
        args = self.args
        self.grid_probe = speed_probe(self.runner)
        self.measured = measure_backend(self.runner, self.engine_args, args.quick, args.warmup,
                                        args.repeats, engine_loop=False, log=self.log)
        if not args.engine_loop:
            after = self._probe_after()
            self.probes = [{k: (v + after[k]) / 2 for k, v in self.grid_probe.items()}]

    def measure_level(self) -> dict[str, float]:
        """One round (nothing without the engine loop): another timed pass of the grid, whose
        medians then span the rounds (on a drifting host one measurement of the grid bent the
        profile's shape: a 96-token prefill took 130 ms in one grid, 109 ms in another), the
        engine-loop workloads, and the host-speed probe right after: the probe the round's runs
        start from."""
        from twinserve.gpu.engine_loop import measure_engine_loop
        from twinserve.gpu.profiler import speed_probe
        if self.measured is None:
            raise RuntimeError("measure_grid first")
        if not self.args.engine_loop:
            return speed_probe(self.runner)
        grid = self.measured.grid
        if grid is not None and grid.steps:
            grid.time_pass()
            self.measured.micro = grid.samples()
            self.log(f"micro-benchmarks: pass {len(grid.times[0])} of {len(grid.steps)} steps "
                     "timed (the grid's medians now span the rounds)")
        self.measured.loop += measure_engine_loop(self.runner, self.engine_args,
                                                  self.args.quick, self.log)
        probe = self._probe_after()
        self.probes.append(probe)
        return probe

    def _probe_after(self) -> dict[str, float]:
        from twinserve.gpu.profiler import speed_probe
        probe = speed_probe(self.runner)
        before = self.grid_probe
        self.log(f"host-speed probe: {len(probe)} steps, after the measurement "
                 f"{statistics.median(probe[k] / before[k] for k in before):.3f}x their time "
                 "before")
        return probe

    def fit(self, model_name: str) -> Calibration:
        """``simulator.calibration.fit_backend`` of the grid and every round, with the mean of
        the rounds' probes (the speed its level stands for)."""
        from twinserve.simulator.calibration import fit_backend
        m = self.measured
        if m is None or not self.probes:
            raise RuntimeError("measure_grid and at least one measure_level first")
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
        from twinserve.gpu.platform import current_platform
        from twinserve.simulator.calibration import save_profile
        from twinserve.simulator.model_spec import load_model_spec
        cal = self.fit(load_model_spec(self.args.model).name)
        platform = current_platform(self.runner.device)
        rounds = len(self.probes) if self.args.engine_loop else 0
        cal.params = dataclasses.replace(cal.params, source=(
            f"twinserve calibrate on {platform.device_name} ({len(cal.samples)} steps), the "
            f"engine loop in {rounds} round(s) between the real runs"))
        base = self.args.base_hardware or base_hardware_for(self.args.device)
        out = save_profile(cal, self.args.model, base, path, self.engine_args.block_size, note,
                           platform, measure_interconnect(self.runner, self.engine_args, self.log))
        write_samples(samples_path(out), cal.samples)
        self.log(cal.report)
        return out


def samples_path(profile: Path) -> Path:
    """Where ``InterleavedCalibration.save`` writes the samples of the profile at ``profile``."""
    return profile.with_name(f"{profile.stem}_samples.csv")
