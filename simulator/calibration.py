"""Calibration: from measured steps of the real backend to a fitted hardware profile (no torch).

A *sample* is one measured step: the scheduler's aggregate fields of its ``SchedulerOutput``
(``AGGREGATE_FIELDS``, what ``gpu.profiler`` records and what the run folder's
``step_features.csv`` holds) and the seconds it took. Features are derived with the cost model's own
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
step minus ``ModelRunner.execute``) are both linear in the same features; ``combine`` adds them.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from twinserve.core.outputs import AGGREGATE_FIELDS, SchedulerOutput
from twinserve.simulator.cost_model import FEATURE_NAMES, nnls, step_features
from twinserve.simulator.hardware import FittedParams, HardwareProfile

STEP_KINDS = ("prefill", "decode", "mixed", "swap")
SAMPLE_COLUMNS = ("kind", *AGGREGATE_FIELDS, "seconds", "execute_seconds")
WEIGHTINGS = ("relative", "absolute")


@dataclass(slots=True)
class StepSample:
    """One measured step. ``execute_seconds`` is the forward pass alone when it was timed apart
    from the whole engine step (``nan`` otherwise)."""

    aggregates: dict[str, int]
    seconds: float
    execute_seconds: float = math.nan
    kind: str = field(default="")

    def __post_init__(self) -> None:
        unknown = sorted(set(self.aggregates) - set(AGGREGATE_FIELDS))
        if unknown:
            raise ValueError(f"unknown aggregate field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(AGGREGATE_FIELDS)}.")
        if not math.isfinite(self.seconds) or self.seconds < 0:
            raise ValueError(f"seconds must be finite and >= 0, got {self.seconds!r}.")
        if not self.kind:
            self.kind = step_kind(self.aggregates)

    @property
    def features(self) -> dict[str, float]:
        return features_of(self.aggregates)


def step_kind(aggregates: Mapping[str, int]) -> str:
    """``prefill`` (chunks only), ``decode`` (decodes only), ``mixed`` or ``swap`` (no tokens)."""
    prefill, decode = aggregates.get("num_prefill_seqs", 0), aggregates.get("num_decode_seqs", 0)
    if prefill and decode:
        return "mixed"
    if prefill:
        return "prefill"
    return "decode" if decode else "swap"


def features_of(aggregates: Mapping[str, int]) -> dict[str, float]:
    """The cost model's features of a step given by its aggregate fields."""
    out = SchedulerOutput(**{k: int(aggregates.get(k, 0)) for k in AGGREGATE_FIELDS})
    return step_features(out)


def predict(params: FittedParams, aggregates: Mapping[str, int]) -> float:
    """The fitted step time (the forward-pass part of ``FittedCostModel.step_time``)."""
    features = features_of(aggregates)
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
    rows = [(s.features, getattr(s, target)) for s in samples
            if s.aggregates.get("total_num_scheduled_tokens", 0) > 0
            and math.isfinite(getattr(s, target))]
    if not rows:
        raise ValueError(f"no sample with scheduled tokens and a finite {target} to fit.")
    if weighting == "absolute":
        from twinserve.simulator.cost_model import fit_step_time
        return fit_step_time(rows, model, tensor_parallel_size)
    x = np.array([[1.0, *(f.get(n, 0.0) for n in FEATURE_NAMES)] for f, _ in rows])
    y = np.array([s for _, s in rows])
    w = 1.0 / np.maximum(y, 1e-6)
    coef = nnls(x * w[:, None], y * w)
    rmse = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
    return FittedParams(float(coef[0]), dict(zip(FEATURE_NAMES, map(float, coef[1:]))), model,
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
            predicted += predict(params, s.aggregates)
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
    coefficients = {n: forward.coefficients.get(n, 0.0) + overhead.coefficients.get(n, 0.0)
                    for n in FEATURE_NAMES}
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
        p = predict(params, s.aggregates) + (predict(offset, s.aggregates) if offset else 0.0)
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
    lines = [f"{title}:", f"  {'kind':<8} {'steps':>6} {'MAPE %':>8} {'max %':>8} "
                          f"{'measured s':>11} {'predicted s':>12}"]
    for e in errors:
        lines.append(f"  {e.kind:<8} {e.count:>6} {e.mape:>8.1f} {e.max_ape:>8.1f} "
                     f"{e.measured_s:>11.3f} {e.predicted_s:>12.3f}")
    return "\n".join(lines)


def calibrated_profile(base: HardwareProfile, params: FittedParams,
                       pcie_bandwidth: float | None = None, name: str | None = None,
                       note: str = "") -> HardwareProfile:
    """``base`` (its roofline numbers) holding ``params``; ``pcie_bandwidth`` (bytes/s, measured
    swap copies) replaces the base's when given."""
    from dataclasses import replace
    changes: dict = {}
    if pcie_bandwidth is not None and math.isfinite(pcie_bandwidth) and pcie_bandwidth > 0:
        changes["pcie_bandwidth"] = float(pcie_bandwidth)
    if name:
        changes["name"] = name
    if note:
        changes["notes"] = (base.notes + " " if base.notes else "") + note
    return replace(base, **changes).with_fitted(params)


# ---- samples on disk (the run folder's step_features.csv) ----------------------------------
def write_samples(path: str | Path, samples: Iterable[StepSample]) -> Path:
    path = Path(path)
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(SAMPLE_COLUMNS)
        for s in samples:
            w.writerow([s.kind, *(int(s.aggregates.get(k, 0)) for k in AGGREGATE_FIELDS),
                        repr(round(s.seconds, 9)),
                        "" if math.isnan(s.execute_seconds) else repr(round(s.execute_seconds, 9))])
    return path


def read_samples(path: str | Path) -> list[StepSample]:
    """Samples from a CSV written by ``write_samples``, or from a run folder holding one
    (``step_features.csv``)."""
    path = Path(path)
    if path.is_dir():
        path = path / "step_features.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no step samples (validate writes step_features.csv into "
                                "the real run folder).")
    out = []
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            try:
                aggregates = {k: int(row[k]) for k in AGGREGATE_FIELDS}
                execute = float(row["execute_seconds"]) if row.get("execute_seconds") else math.nan
                out.append(StepSample(aggregates, float(row["seconds"]), execute, row.get("kind", "")))
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{path}:{i}: bad step sample row ({exc}).") from None
    return out
