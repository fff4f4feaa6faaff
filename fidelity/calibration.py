"""Calibrating the twin: a profile from the real backend, from recorded runs, or re-levelled.

``calibrate`` times the backend (micro-benchmark grid, swap copies, engine-loop workloads; over
the engine's whole step space or a part of it, ``StepSpace``) and fits the simulator's step time;
``calibrate_from_runs`` fits the steps real replays recorded; ``relevel`` rescales a profile to
the host's speed now. Each writes a profile JSON that ``twinserve simulate --hardware`` reads.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinserve.fidelity.backend import (
    Log,
    base_hardware_for,
    load_runner,
    measure_interconnect,
    model_dir_or_default,
    with_model,
)
from twinserve.fidelity.settings import CalibrationSettings
from twinserve.fidelity.step_space import StepSpace

KV_LINK_BLOCKS = 256  # the measured regions' blocks (64-block transfers, 4 at once)

if TYPE_CHECKING:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.simulator.calibration import Calibration


@dataclass(slots=True, frozen=True)
class CalibrationResult:
    """The profile written at ``profile``, the fit (``calibration``: its params, samples and
    report) and the model directory it was fitted for."""

    profile: Path
    calibration: Calibration
    model: str


def calibrate(engine: EngineArgs, out: str | Path,
              settings: CalibrationSettings | None = None,
              space: StepSpace | None = None, log: Log | None = None) -> CalibrationResult:
    """Times the real backend ``engine`` describes (within ``space``, else its whole step space)
    and writes the fitted profile to ``out``, with the grammar-mask timing of structured outputs."""
    from twinserve.fidelity.interleaved import InterleavedCalibration
    from twinserve.fidelity.mask_timing import add_mask_timing
    from twinserve.fidelity.threads import set_threads
    from twinserve.gpu.worker.platform import current_platform
    from twinserve.simulator.calibration import save_profile
    from twinserve.simulator.hardware import STEP_SPACE_KEYS, load_hardware
    from twinserve.simulator.model_spec import load_model_spec
    log = log or (lambda msg: None)
    settings = settings or CalibrationSettings()
    engine = with_model(engine)
    model = str(engine.model)
    name = settings.profile_model or load_model_spec(model).name
    base = settings.base_hardware or base_hardware_for(engine.device)
    load_hardware(base)  # a bad base fails now, not after the measurement
    if engine.device != "cuda":
        set_threads(settings.num_threads)
    runner = load_runner(engine)
    log(f"calibrating {name} on {runner.device} ({runner.dtype}), {runner.num_gpu_blocks} KV "
        "blocks")
    measurement = InterleavedCalibration(settings, engine, runner, log, space=space)
    measurement.measure_grid()
    measurement.measure_level()
    cal = measurement.fit(name)
    platform = current_platform(runner.device)
    dtype = str(runner.dtype).removeprefix("torch.")
    device = platform.device_name
    cal.params = dataclasses.replace(cal.params, source=(
        f"twinserve calibrate on {device} ({dtype}, {len(cal.samples)} steps)"))
    note = f"Calibrated for {name} on {device} {dtype}{' (quick)' if settings.quick else ''}."
    limits = runner.engine_config.scheduler
    covered = space or StepSpace(limits.max_num_seqs, limits.max_num_batched_tokens,
                                 runner.max_model_len)
    path = save_profile(cal, model, base, out, engine.block_size, note, platform,
                        measure_interconnect(runner, engine, log), engine.kernel_settings(),
                        dict(zip(STEP_SPACE_KEYS, covered.as_tuple())))
    path = add_mask_timing(path, runner, log)
    path = with_stage_slowdown(path, measurement.stage_slowdowns)
    return CalibrationResult(add_kv_link(path, runner, log), cal, model)


def measure_stage_slowdown(runner: Any, log: Log) -> float | None:
    """Under pipeline parallelism on a CPU, how much slower a stage computes beside another
    (``gpu.measurement.stage_overlap``); None elsewhere: GPUs are separate devices (1.0)."""
    if runner.device.type != "cpu" or not runner.can_queue_batches:
        return None
    from twinserve.gpu.measurement.stage_overlap import measure_stage_overlap
    overlap = measure_stage_overlap(runner)
    log(overlap.describe())
    return overlap.slowdown


def with_stage_slowdown(profile_path: Path, slowdowns: Sequence[float]) -> Path:
    """The profile with the median of ``slowdowns`` as its ``shared_stage_slowdown`` (none
    measured: left as it is)."""
    if not slowdowns:
        return profile_path
    from twinserve.simulator.hardware import load_hardware
    profile = dataclasses.replace(load_hardware(profile_path),
                                  shared_stage_slowdown=statistics.median(slowdowns))
    return profile.save(profile_path)


def add_kv_link(profile_path: Path, runner: Any, log: Log) -> Path:
    """Measures the Peer connector between two processes here, for ``runner``'s KV layout,
    and stores the fitted link as the profile's ``kv_link`` (what the twin's P/D runs use).
    On CUDA the transfers are not measured here (cuda_check.sh): the profile keeps its presets."""
    if runner.device.type != "cpu":
        return profile_path
    from twinserve.gpu.kv_transfer.region import KVLayout
    from twinserve.gpu.measurement.kv_transfer import aggregate_bandwidth, measure_link
    from twinserve.simulator.hardware import load_hardware
    layout = KVLayout.of(runner.kv_cache.spec, len(runner.kv_cache.gpu_slots), KV_LINK_BLOCKS)
    fit, samples = measure_link(layout)
    shared = ", ".join(f"{c} at once {bw / 1e9:.2f} GB/s"
                       for c, bw in aggregate_bandwidth(samples).items())
    log(f"kv link (PeerConnector, shared memory): {fit.describe()} ({shared})")
    profile = dataclasses.replace(load_hardware(profile_path), kv_link=fit.to_kv_link())
    return profile.save(profile_path)


def calibrate_from_runs(run_dirs: Sequence[str | Path], out: str | Path,
                        model: str | None = None, profile_model: str | None = None,
                        tensor_parallel_size: int | None = None,
                        backend_samples: str | Path | None = None,
                        base_hardware: str | None = None,
                        block_size: int | None = None) -> CalibrationResult:
    """A profile fitted on the steps real replays recorded (``RUN/step_features.csv``), jointly
    with a backend calibration's samples when ``backend_samples`` names their CSV. The model and
    TP degree default to the runs' ``config.json``."""
    from twinserve.core.step_sample import read_samples
    from twinserve.simulator.calibration import calibrate_from_runs as fit_runs
    from twinserve.simulator.calibration import runs_kernel_settings, save_profile
    from twinserve.simulator.model_spec import load_model_spec
    if not run_dirs:
        raise ValueError("run_dirs: give at least one recorded run folder.")
    dirs = [str(d) for d in run_dirs]
    model = model or _model_from_runs(dirs) or model_dir_or_default(None)
    name = profile_model or load_model_spec(model).name
    tp = tensor_parallel_size or int(str(from_runs(dirs, "tensor_parallel_size") or 1))
    backend = read_samples(backend_samples) if backend_samples else []
    cal = fit_runs(dirs, name, tp, backend)
    cal.params = dataclasses.replace(
        cal.params, source=f"twinserve calibrate --from-run ({len(dirs)} recorded run(s))")
    path = save_profile(cal, model, base_hardware or "cpu", out, block_size or 16,
                        f"Calibrated from the steps of {', '.join(dirs)}.",
                        kernel_settings=runs_kernel_settings(dirs))
    return CalibrationResult(path, cal, model)


def relevel(profile: str | Path, engine: EngineArgs, out: str | Path,
            settings: CalibrationSettings | None = None) -> tuple[Path, float]:
    """``profile`` with every fit scaled to the host's speed now (its fit's speed probe timed on
    ``engine``'s backend), written to ``out``; returns the path and the speed factor."""
    from twinserve.fidelity.threads import set_threads
    from twinserve.gpu.measurement.profiler import speed_probe
    from twinserve.simulator.hardware import load_hardware
    from twinserve.simulator.model_spec import load_model_spec
    settings = settings or CalibrationSettings()
    loaded = load_hardware(profile)
    engine = with_model(engine)
    name = settings.profile_model or load_model_spec(str(engine.model)).name
    fit = loaded.find_fitted(name, engine.tensor_parallel_size)
    if fit is None:
        raise ValueError(f"relevel: {profile} holds no fit for {name} at TP "
                         f"{engine.tensor_parallel_size}.")
    if engine.device != "cuda":
        set_threads(settings.num_threads)
    factor = fit.host_speed(speed_probe(load_runner(engine)))
    return loaded.at_host_speed(factor).save(out), factor


def _model_from_runs(run_dirs: list[str]) -> str | None:
    model = from_runs(run_dirs, "model")
    return None if model is None else str(model)


def from_runs(run_dirs: Sequence[str | Path], key: str) -> object:
    """``key`` of the first run folder's ``config.json`` that has it."""
    import json
    for d in run_dirs:
        path = Path(d) / "config.json"
        if path.is_file():
            value = json.loads(path.read_text()).get(key)
            if value:
                return value
    return None
