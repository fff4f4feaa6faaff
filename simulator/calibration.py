"""Calibration: from measured steps of the real backend to a fitted hardware profile (no torch).

A *sample* (``core.step_sample.StepSample``) is one measured step: the scheduler's aggregate fields
of its ``SchedulerOutput`` (``AGGREGATE_FIELDS``, what ``gpu.profiler`` records and what the run
folder's ``step_features.csv`` holds) and the seconds it took. Features are derived with the cost model's own
``step_features``, so the fit and the simulator read a step the same way::

    samples (aggregates, seconds) --step_features--> (features, seconds) --NNLS--> FittedParams
    base profile (roofline numbers) + FittedParams  --with_fitted-->  calibrated HardwareProfile

Two sources of samples, two weightings:

- micro-benchmarks (hand-built steps, median of repeats): chosen by design, not by frequency, so
  the fit minimises the *relative* error (each row divided by its seconds);
- the steps of a real engine run (``--from-run``): weighted as they occur, *absolute* least squares
  with an intercept, so the predicted total of the run's step times matches the measured total
  (what throughput and latency of a replay depend on).

A forward-pass fit and a loop-overhead fit (scheduling, sampling, output processing: the engine
step minus ``ModelRunner.execute``) are both linear in the same features; ``combine`` adds them
(``fit_backend``). ``calibrate_from_runs`` fits recorded runs; ``save_profile`` writes the result.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from twinserve.core.engine_config import Platform
from twinserve.core.outputs import AGGREGATE_FIELDS, SchedulerOutput
from twinserve.core.step_sample import STEP_KINDS, StepSample, read_samples
from twinserve.simulator.cost_model import (
    FEATURE_NAMES,
    CostModel,
    fit_feature_names,
    fit_step_time,
    make_cost_model,
    nnls,
    step_features,
)
from twinserve.simulator.hardware import FittedParams, HardwareProfile, load_hardware
from twinserve.simulator.model_spec import load_model_spec

WEIGHTINGS = ("relative", "absolute")


def output_of(aggregates: Mapping[str, int]) -> SchedulerOutput:
    """A ``SchedulerOutput`` holding only the aggregate fields (what the cost model reads)."""
    return SchedulerOutput(**{k: int(aggregates.get(k, 0)) for k in AGGREGATE_FIELDS})


def features_of(aggregates: Mapping[str, int]) -> dict[str, float]:
    """The cost model's features of a step given by its aggregate fields."""
    return step_features(output_of(aggregates))


def sample_features(sample: StepSample) -> dict[str, float]:
    """``features_of`` the sample's aggregates, plus its LoRA features (``LORA_FEATURE_NAMES``)
    when it ran adapters: fits over such samples hold LoRA coefficients (``fit_feature_names``)."""
    features = features_of(sample.aggregates)
    lora = sample.lora_features
    return {**features, **lora} if lora else features


def predict(params: FittedParams, aggregates: Mapping[str, int]) -> float:
    """The fitted step time (the forward-pass part of ``FittedCostModel.step_time``)."""
    return _predicted(params, features_of(aggregates))


def predict_sample(params: FittedParams, sample: StepSample) -> float:
    """``predict`` of a sample, its LoRA features (if it carries them) included."""
    return _predicted(params, sample_features(sample))


def _predicted(params: FittedParams, features: Mapping[str, float]) -> float:
    return params.intercept_s + sum(params.coefficients.get(f, 0.0) * v for f, v in features.items())


def fit(samples: Sequence[StepSample], model: str | None = None, tensor_parallel_size: int = 1,
        weighting: str = "absolute", target: str = "seconds") -> FittedParams:
    """NNLS fit of ``target`` (``seconds`` or ``execute_seconds``) on ``[1, *FEATURE_NAMES]``.

    ``absolute`` is ``cost_model.fit_step_time``; ``relative`` divides each row by its target, so
    a 5 ms decode weighs as much as a 2 s prefill. Swap-only samples (no tokens) are left out: the
    fitted model times swaps with the roofline's copy term.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}.")
    rows = [(sample_features(s), getattr(s, target)) for s in samples
            if s.aggregates.get("total_num_scheduled_tokens", 0) > 0
            and math.isfinite(getattr(s, target))]
    if not rows:
        raise ValueError(f"no sample with scheduled tokens and a finite {target} to fit.")
    if weighting == "absolute":
        return fit_step_time(rows, model, tensor_parallel_size)
    names = fit_feature_names(f for f, _ in rows)
    x = np.array([[1.0, *(f.get(n, 0.0) for n in names)] for f, _ in rows])
    y = np.array([s for _, s in rows])
    w = 1.0 / np.maximum(y, 1e-6)
    coef = nnls(x * w[:, None], y * w)
    rmse = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
    return FittedParams(float(coef[0]), dict(zip(names, map(float, coef[1:]))), model,
                        tensor_parallel_size, len(rows), rmse)


def fit_runs(runs: Sequence[Sequence[StepSample]], model: str | None = None,
             tensor_parallel_size: int = 1, rounds: int = 4) -> tuple[FittedParams, list[float]]:
    """Absolute fit over the steps of several runs, at the speed of the median run.

    On a shared host one run's steps can take a third longer than the next run's. Pooled as
    measured, the slow runs pull the fit above the typical speed, and near saturation a queue
    turns that into latencies well above the median run's. So each run gets a speed (its
    measured seconds over the fit's), the runs are brought to the median speed and the fit is
    repeated; a few rounds settle it. Returns the fit and each run's speed relative to it.
    """
    scales = [1.0] * len(runs)
    for _ in range(rounds):
        pooled = [StepSample(s.aggregates, s.seconds / k, s.execute_seconds / k, s.kind)
                  for run, k in zip(runs, scales) for s in run]
        params = fit(pooled, model, tensor_parallel_size, "absolute")
        speeds = [run_speed(params, run) for run in runs]
        middle = statistics.median(v for v in speeds if math.isfinite(v))
        scales = [v / middle if math.isfinite(v) else 1.0 for v in speeds]
    return params, speeds


def run_speed(params: FittedParams, samples: Iterable[StepSample]) -> float:
    """Measured over predicted seconds of the steps with tokens (``nan`` when there are none)."""
    measured = predicted = 0.0
    for s in samples:
        if s.aggregates.get("total_num_scheduled_tokens", 0) > 0:
            measured += s.seconds
            predicted += predict_sample(params, s)
    return measured / predicted if predicted > 0 else math.nan


def fit_overhead(samples: Sequence[StepSample], model: str | None = None,
                 tensor_parallel_size: int = 1) -> FittedParams:
    """The engine loop's cost beyond the forward pass (``seconds - execute_seconds``), fitted on
    the steps that timed both; absolute weighting (it is a small additive term)."""
    rows = [StepSample(s.aggregates, max(0.0, s.seconds - s.execute_seconds), kind=s.kind)
            for s in samples if math.isfinite(s.execute_seconds)]
    return fit(rows, model, tensor_parallel_size, "absolute")


def combine(forward: FittedParams, overhead: FittedParams) -> FittedParams:
    """The sum of two fits over the same features (forward pass + loop overhead)."""
    names = dict.fromkeys((*FEATURE_NAMES, *forward.coefficients, *overhead.coefficients))
    coefficients = {n: forward.coefficients.get(n, 0.0) + overhead.coefficients.get(n, 0.0)
                    for n in names}
    return FittedParams(forward.intercept_s + overhead.intercept_s, coefficients, forward.model,
                        forward.tensor_parallel_size, forward.num_samples + overhead.num_samples,
                        math.hypot(forward.rmse_s, overhead.rmse_s))


@dataclass(slots=True, frozen=True)
class KindError:
    """Fit error over one step kind: mean and max absolute percentage error."""

    kind: str
    count: int
    mape: float
    max_ape: float
    measured_s: float  # total measured seconds of these steps
    predicted_s: float  # total predicted seconds


def fit_errors(params: FittedParams, samples: Iterable[StepSample], target: str = "seconds",
               offset: FittedParams | None = None) -> list[KindError]:
    """Per step kind (and ``all``): how far ``params`` (+ ``offset``) lands from the measurements."""
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        y = getattr(s, target)
        if s.kind == "swap" or not math.isfinite(y) or y <= 0:
            continue
        p = predict_sample(params, s) + (predict_sample(offset, s) if offset else 0.0)
        by_kind.setdefault(s.kind, []).append((y, p))
    out = []
    for kind in [k for k in STEP_KINDS if k in by_kind] + ["all"]:
        pairs = [yp for k, v in by_kind.items() for yp in v] if kind == "all" else by_kind[kind]
        if not pairs:
            continue
        ape = [abs(p - y) / y for y, p in pairs]
        out.append(KindError(kind, len(pairs), 100 * sum(ape) / len(ape), 100 * max(ape),
                             sum(y for y, _ in pairs), sum(p for _, p in pairs)))
    return out


def format_errors(errors: Sequence[KindError], title: str = "fit error") -> str:
    header = (f"  {'kind':<8} {'steps':>6} {'MAPE %':>8} {'max %':>8} "
              f"{'measured s':>11} {'predicted s':>12}")
    lines = [f"{title}:", header]
    for e in errors:
        lines.append(f"  {e.kind:<8} {e.count:>6} {e.mape:>8.1f} {e.max_ape:>8.1f} "
                     f"{e.measured_s:>11.3f} {e.predicted_s:>12.3f}")
    return "\n".join(lines)


def calibrated_profile(base: HardwareProfile, params: FittedParams,
                       pcie_bandwidth: float | None = None, name: str | None = None,
                       note: str = "") -> HardwareProfile:
    """``base`` (its roofline numbers) holding ``params``; ``pcie_bandwidth`` (bytes/s, measured
    swap copies) replaces the base's when given."""
    changes: dict = {}
    if pcie_bandwidth is not None and math.isfinite(pcie_bandwidth) and pcie_bandwidth > 0:
        changes["pcie_bandwidth"] = float(pcie_bandwidth)
    if name:
        changes["name"] = name
    if note:
        changes["notes"] = (base.notes + " " if base.notes else "") + note
    return replace(base, **changes).with_fitted(params)


# ---- a calibration: its fit, its samples and the report of its errors ----------------------
@dataclass(slots=True)
class Calibration:
    """A fit and what it was fitted on. ``params`` is what goes into the profile; ``forward`` and
    ``overhead`` are its two parts in a backend calibration (``None`` otherwise)."""

    params: FittedParams
    samples: list[StepSample] = field(default_factory=list)
    forward: FittedParams | None = None
    overhead: FittedParams | None = None
    seconds_per_swap_block: float | None = None
    report: str = ""


def fit_backend(micro: Sequence[StepSample], loop: Sequence[StepSample], model_name: str,
                seconds_per_swap_block: float | None = None,
                lora: Sequence[StepSample] = (), tensor_parallel_size: int = 1) -> Calibration:
    """The forward pass fitted on every forward timing (relative error), the loop overhead (step
    minus forward) on the engine loop's steps; ``params`` is their sum (the forward pass alone
    without loop steps). ``lora``: steps with adapters (``gpu.profiler.measure_lora``), whose
    features give the fit its LoRA coefficients."""
    samples = [*micro, *lora, *loop]
    forward = fit(samples, model_name, tensor_parallel_size, "relative",
                  target="execute_seconds")
    lines = [format_errors(fit_errors(forward, micro, "execute_seconds"),
                           "forward-pass fit on the micro-benchmarks (ModelRunner.execute)")]
    if lora:
        lines.append(format_errors(fit_errors(forward, lora, "execute_seconds"),
                                   "forward-pass fit on the LoRA steps (adapters loaded or resident)"))
    overhead = None
    params = forward
    if loop:
        overhead = fit_overhead(loop, model_name, tensor_parallel_size)
        params = combine(forward, overhead)
        lines.append(format_errors(fit_errors(params, loop, "seconds"),
                                   "step fit on the engine-loop steps (whole engine.step)"))
    return Calibration(params, samples, forward, overhead, seconds_per_swap_block,
                       "\n".join(lines))


def calibrate_from_runs(run_dirs: Sequence[str | Path], model_name: str,
                        tensor_parallel_size: int = 1) -> Calibration:
    """Absolute least squares over the recorded steps of real runs, at the median run's speed
    (``fit_runs``), stored for the runs' ``tensor_parallel_size``."""
    runs = [read_samples(d) for d in run_dirs]
    params, speeds = fit_runs(runs, model_name, tensor_parallel_size)
    samples = [s for run in runs for s in run]
    report = format_errors(fit_errors(params, samples, "seconds"),
                           f"step fit on {len(samples)} recorded steps of {len(run_dirs)} run(s)")
    if len(runs) > 1:
        report += ("\nrun speed, measured over fitted step time (the fit is at the median run's): "
                   + " ".join(f"{v:.2f}" for v in speeds))
    return Calibration(params, samples, report=report)


def save_profile(cal: Calibration, model: str, base_hardware: str, out: str | Path,
                 block_size: int = 16, note: str = "", platform: Platform | None = None,
                 interconnect: tuple[float, float] | None = None) -> Path:
    """The base profile + ``cal.params`` (+ the measured swap bandwidth) written to ``out``.
    ``platform``: the measured device, whose type and bf16 support the profile then records,
    so the twin resolves the engine arguments as the real engine did there."""
    base = load_hardware(base_hardware)
    if platform is not None:
        base = replace(base, device_type=platform.device_type, native_bf16=platform.native_bf16)
    if interconnect is not None:  # the measured all-reduce (bandwidth B/s, latency s)
        base = replace(base, interconnect_bandwidth=interconnect[0],
                       interconnect_latency_s=interconnect[1])
    pcie = None
    if cal.seconds_per_swap_block:
        # the simulator times a swap as spec block bytes / pcie_bandwidth: match the measurement
        block_bytes = CostModel(load_model_spec(model), base, cal.params.tensor_parallel_size,
                                block_size).block_bytes()
        pcie = block_bytes / cal.seconds_per_swap_block
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    name = base.name if base.name.endswith("-calibrated") else f"{base.name}-calibrated"
    profile = calibrated_profile(base, cal.params, pcie, name=name, note=note)
    return profile.save(out)


def predicted_seconds(samples: Iterable[StepSample], model: str, profile: str | Path,
                      block_size: int, tensor_parallel_size: int = 1) -> float:
    """The total seconds the profile's cost model gives the very steps of ``samples`` (what
    ``validate`` sets against their measured total)."""
    cost = make_cost_model(load_model_spec(model), load_hardware(profile), tensor_parallel_size,
                           block_size)
    return sum(cost.step_time(output_of(s.aggregates)) for s in samples)
