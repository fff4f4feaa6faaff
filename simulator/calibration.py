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
step minus ``ModelRunner.execute``; batch and token counts only, ``OVERHEAD_FEATURES``) are both
linear in the same features; ``combine`` adds them. ``fit_joint`` (``fit_backend``) fits every
source at once, micro-benchmarks, engine-loop steps and real runs, each source weighing the same
in total, the forward fit refitted without outliers (``fit_trimmed``: a shared host slows one
timing in twenty several-fold), and reports the error per region of the step space
(``region_of``). ``calibrate_from_runs`` fits recorded runs (jointly with a backend calibration's
samples when given); ``save_profile`` writes the result.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from twinserve.core.engine_config import Platform
from twinserve.core.kernel_settings import KernelSettings
from twinserve.core.outputs import AGGREGATE_FIELDS, SchedulerOutput
from twinserve.core.step_sample import STEP_KINDS, StepSample, read_samples, step_kind
from twinserve.simulator.cost_model import (
    FEATURE_NAMES,
    TOKEN_STEP_NAMES,
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
STEP_PRIOR_SAMPLES = 1.0
_TOKEN_STEPS = frozenset(TOKEN_STEP_NAMES)


def output_of(aggregates: Mapping[str, int]) -> SchedulerOutput:
    """A ``SchedulerOutput`` holding only the aggregate fields (what the cost model reads)."""
    fields: dict[str, Any] = {k: int(aggregates.get(k, 0)) for k in AGGREGATE_FIELDS}
    return SchedulerOutput(**fields)


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


def _fittable(s: StepSample, target: str) -> bool:
    return (s.aggregates.get("total_num_scheduled_tokens", 0) > 0
            and math.isfinite(getattr(s, target)))


def fit(samples: Sequence[StepSample], model: str | None = None, tensor_parallel_size: int = 1,
        weighting: str = "absolute", target: str = "seconds", kernel: bool = False,
        weights: Sequence[float] | None = None) -> FittedParams:
    """NNLS fit of ``target`` (``seconds`` or ``execute_seconds``) on ``[1, *FEATURE_NAMES]``
    (``kernel``: the backend's kernel terms too, ``KERNEL_FEATURE_NAMES``).

    ``absolute`` is ``cost_model.fit_step_time``; ``relative`` divides each row by its target, so
    a 5 ms decode weighs as much as a 2 s prefill. ``weights`` (one per sample, relative only)
    multiply the rows: ``fit_joint`` gives each source of samples the same total weight.
    Swap-only samples (no tokens) are left out: the fitted model times swaps with the roofline's
    copy term.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}.")
    if weights is not None and (len(weights) != len(samples) or weighting != "relative"):
        raise ValueError("weights must hold one value per sample, with relative weighting.")
    keep = [i for i, s in enumerate(samples) if _fittable(s, target)]
    rows = [(sample_features(samples[i]), getattr(samples[i], target)) for i in keep]
    if not rows:
        raise ValueError(f"no sample with scheduled tokens and a finite {target} to fit.")
    if weighting == "absolute":
        return fit_step_time(rows, model, tensor_parallel_size, kernel)
    names = fit_feature_names((f for f, _ in rows), kernel)
    x = np.array([[1.0, *(f.get(n, 0.0) for n in names)] for f, _ in rows])
    y = np.array([s for _, s in rows])
    w = 1.0 / np.maximum(y, 1e-6)
    if weights is not None:
        w = w * np.sqrt(np.array([weights[i] for i in keep], dtype=float))
    a, b = _with_step_prior(x * w[:, None], y * w, names, w)
    coef = nnls(a, b)
    rmse = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
    return FittedParams(float(coef[0]), dict(zip(names, map(float, coef[1:]))), model,
                        tensor_parallel_size, len(rows), rmse)


def _with_step_prior(a: np.ndarray, b: np.ndarray, names: Sequence[str],
                     w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The weighted system with one row per ``TOKEN_STEP_NAMES`` column saying "no jump", as
    much as ``STEP_PRIOR_SAMPLES`` typical rows: a jump the grid times on both sides (every
    decode batch size) stands, one that only a sample or two would carry shrinks."""
    columns = [1 + i for i, name in enumerate(names) if name in _TOKEN_STEPS]
    if not columns:
        return a, b
    prior = np.zeros((len(columns), a.shape[1]))
    prior[np.arange(len(columns)), columns] = math.sqrt(STEP_PRIOR_SAMPLES) * float(np.median(w))
    return np.vstack([a, prior]), np.concatenate([b, np.zeros(len(columns))])


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
        params = fit(pooled, model, tensor_parallel_size, "absolute", kernel=True)
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


# The engine loop's work beyond the forward pass (scheduling, sampling, output processing) is
# Python per sequence and per token: it reads no KV, so its fit has no context term (one would
# only pick up noise, and carry it to longer contexts than were measured).
OVERHEAD_FEATURES = ("num_tokens", "num_prefill_seqs", "num_decode_seqs")


def fit_overhead(samples: Sequence[StepSample], model: str | None = None,
                 tensor_parallel_size: int = 1, cut: float = 4.0) -> FittedParams:
    """The engine loop's cost beyond the forward pass (``seconds - execute_seconds``), fitted on
    the steps that timed both on ``OVERHEAD_FEATURES``; absolute weighting (it is a small
    additive term), refitted once without the steps more than ``cut`` robust standard
    deviations off (a step another process interrupted)."""
    rows = [({k: v for k, v in sample_features(s).items() if k in OVERHEAD_FEATURES},
             max(0.0, s.seconds - s.execute_seconds))
            for s in samples if math.isfinite(s.execute_seconds) and _fittable(s, "seconds")]
    if not rows:
        raise ValueError("no step with scheduled tokens and a timed forward pass to fit.")
    params = fit_step_time(rows, model, tensor_parallel_size)
    residuals = [_predicted(params, f) - y for f, y in rows]
    middle = statistics.median(residuals)
    scale = 1.4826 * statistics.median(abs(r - middle) for r in residuals)
    kept = [row for row, r in zip(rows, residuals) if abs(r - middle) <= cut * scale]
    if scale > 0 and len(rows) // 2 <= len(kept) < len(rows):
        params = replace(fit_step_time(kept, model, tensor_parallel_size), num_samples=len(rows))
    return params


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
    by_kind = _grouped_pairs(params, samples, target, offset, lambda s: s.kind)
    by_kind["all"] = [yp for pairs in list(by_kind.values()) for yp in pairs]
    return [_error(kind, by_kind[kind])
            for kind in [k for k in STEP_KINDS if k in by_kind] + ["all"] if by_kind[kind]]


def _grouped_pairs(params: FittedParams, samples: Iterable[StepSample], target: str,
                   offset: FittedParams | None,
                   key: Callable[[StepSample], str]) -> dict[str, list[tuple[float, float]]]:
    """(measured, predicted) pairs of the timed steps (swaps and unmeasured steps left out),
    grouped by ``key``."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        y = getattr(s, target)
        if s.kind == "swap" or not math.isfinite(y) or y <= 0:
            continue
        p = predict_sample(params, s) + (predict_sample(offset, s) if offset else 0.0)
        groups.setdefault(key(s), []).append((y, p))
    return groups


def format_errors(errors: Sequence[KindError], title: str = "fit error",
                  what: str = "kind") -> str:
    width = max([8, *(len(e.kind) for e in errors)])
    header = (f"  {what:<{width}} {'steps':>6} {'MAPE %':>8} {'max %':>8} "
              f"{'measured s':>11} {'predicted s':>12} {'total %':>8}")
    lines = [f"{title}:", header]
    for e in errors:
        total = 100 * (e.predicted_s / e.measured_s - 1) if e.measured_s > 0 else math.nan
        lines.append(f"  {e.kind:<{width}} {e.count:>6} {e.mape:>8.1f} {e.max_ape:>8.1f} "
                     f"{e.measured_s:>11.3f} {e.predicted_s:>12.3f} {total:>+8.1f}")
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


# ---- regions of the step space, and a fit that shrugs off a shared host's outliers --------
BATCH_EDGES = (1, 4, 16, 64)  # decode batch bands: 1, 2-4, 5-16, 17-64, 65+
CONTEXT_EDGES = (128, 512, 2048)  # mean decode context bands
CHUNK_EDGES = (32, 128, 512)  # prefill tokens of a step


def _band(value: float, edges: Sequence[int]) -> str:
    lo = 1
    for edge in edges:
        if value <= edge:
            return f"{edge}" if lo == edge else f"{lo}-{edge}"
        lo = edge + 1
    return f"{lo}+"


def region_of(aggregates: Mapping[str, int]) -> str:
    """The region of the step space a step lies in: decodes by batch and mean context, prefills
    by tokens and whether they follow a cached prefix, mixed steps by batch and prefill tokens."""
    kind = step_kind(aggregates)
    batch, prefill = aggregates.get("num_decode_seqs", 0), aggregates.get("num_prefill_tokens", 0)
    decode_ctx = aggregates.get("sum_decode_context_tokens", 0)
    if kind == "decode":
        return f"decode b{_band(batch, BATCH_EDGES)} ctx{_band(decode_ctx / batch, CONTEXT_EDGES)}"
    if kind == "prefill":
        chunks = aggregates.get("num_prefill_seqs", 1)
        fresh = prefill * (prefill / chunks + 1) / 2  # the context of chunks without a prefix
        cached = aggregates.get("sum_context_tokens", 0) - decode_ctx > fresh + 0.5
        return f"prefill t{_band(prefill, CHUNK_EDGES)} {'cached' if cached else 'fresh'}"
    if kind == "mixed":
        return f"mixed b{_band(batch, BATCH_EDGES)} t{_band(prefill, CHUNK_EDGES)}"
    return kind


def region_errors(params: FittedParams, samples: Iterable[StepSample], target: str = "seconds",
                  offset: FittedParams | None = None) -> list[KindError]:
    """``fit_errors`` per ``region_of`` the steps (in name order), then ``all``."""
    groups = _grouped_pairs(params, samples, target, offset, lambda s: region_of(s.aggregates))
    groups["all"] = [yp for pairs in list(groups.values()) for yp in pairs]
    return [_error(name, groups[name]) for name in (*sorted(set(groups) - {"all"}), "all")
            if groups[name]]


def _error(name: str, pairs: Sequence[tuple[float, float]]) -> KindError:
    ape = [abs(p - y) / y for y, p in pairs]
    return KindError(name, len(pairs), 100 * sum(ape) / len(ape), 100 * max(ape),
                     sum(y for y, _ in pairs), sum(p for _, p in pairs))


def fit_trimmed(samples: Sequence[StepSample], weights: Sequence[float], model: str | None,
                tensor_parallel_size: int = 1, target: str = "execute_seconds", cut: float = 4.0,
                floor: float = 0.15, rounds: int = 3) -> tuple[FittedParams, list[StepSample]]:
    """Relative fit (kernel terms included) that drops outliers and refits: a sample whose
    relative residual exceeds ``cut`` robust standard deviations (1.4826 x the median absolute
    deviation), and at least ``floor``, is taken for a step that another process slowed down
    (on a shared host one timing in twenty can be several times the others). Returns the fit and
    the samples dropped."""
    pairs = [(s, w) for s, w in zip(samples, weights) if _fittable(s, target)]
    dropped: list[StepSample] = []
    for _ in range(rounds):
        params = fit([s for s, _ in pairs], model, tensor_parallel_size, "relative", target,
                     kernel=True, weights=[w for _, w in pairs])
        residuals = [(predict_sample(params, s) - getattr(s, target)) / getattr(s, target)
                     for s, _ in pairs]
        middle = statistics.median(residuals)
        scale = 1.4826 * statistics.median(abs(r - middle) for r in residuals)
        limit = max(cut * scale, floor)
        kept = [(pw, r) for pw, r in zip(pairs, residuals) if abs(r) <= limit]
        if len(kept) == len(pairs) or len(kept) < len(pairs) // 2:
            break
        dropped += [s for (s, _), r in zip(pairs, residuals) if abs(r) > limit]
        pairs = [pw for pw, _ in kept]
    return params, dropped


def split_backend_samples(samples: Iterable[StepSample]) -> tuple[list[StepSample],
                                                                   list[StepSample]]:
    """A backend calibration's samples (``--samples-out``) back into its micro-benchmarks
    (forward pass only: ``seconds == execute_seconds``) and its engine-loop steps."""
    micro: list[StepSample] = []
    loop: list[StepSample] = []
    for s in samples:
        (micro if s.seconds == s.execute_seconds else loop).append(s)
    return micro, loop


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


def fit_joint(sources: Mapping[str, Sequence[StepSample]], model_name: str,
              micro_sources: Iterable[str] = ("micro",), tensor_parallel_size: int = 1,
              seconds_per_swap_block: float | None = None) -> Calibration:
    """One fit over every source of measured steps: micro-benchmarks (forward pass alone, the
    sources named in ``micro_sources``), the engine loop's synthetic workloads and real runs
    (whole steps with their forward pass timed apart). ``Calibration.forward`` is the forward
    fit at the micro-benchmarks' speed (what reproduces them); ``params`` holds it at a live
    engine's speed plus the loop overhead.

    The forward pass is fitted on every forward timing, relative error, each source weighing the
    same in total (a replay's thousand steps do not drown the grid that covers the space), with
    outliers dropped (``fit_trimmed``), then scaled to the speed of the forward passes inside
    the engine loop and the runs (``forward_level``, the median over those sources: a live
    engine's forward pass runs slower than the same step timed back to back, its threads woken
    between steps); the loop overhead (step minus forward pass) on the whole steps, absolute.
    ``params`` is their sum; the report gives the error per region of the step space
    (``region_of``) and per source, and the fit carries its per-kind error."""
    micro_names = set(micro_sources)
    live = {name: list(samples) for name, samples in sources.items() if samples}
    if not live:
        raise ValueError("fit_joint needs at least one non-empty source of samples.")
    weights = [1.0 / len(samples) for samples in live.values() for _ in samples]
    forward, dropped, levels = _fit_at_one_speed(live, weights, micro_names, model_name,
                                                 tensor_parallel_size)
    micro = [s for name, samples in live.items() if name in micro_names for s in samples]
    steps = [s for name, samples in live.items() if name not in micro_names for s in samples]
    lines = []
    if micro:
        lines.append(format_errors(region_errors(forward, micro, "execute_seconds"),
                                   "forward-pass fit on the micro-benchmarks, per region "
                                   "(ModelRunner.execute)", "region"))
    whole = [v for name, v in levels.items() if name not in micro_names]
    live_forward = forward  # at the speed of a live engine's forward passes
    if micro and whole:
        level = statistics.median(whole)
        live_forward = forward.scaled(level)
        lines.append(f"  forward passes inside the engine loop ran at {level:.3f}x the grid's "
                     f"time (median over {len(whole)} source(s) of whole steps): the profile "
                     "is scaled to them, the grid keeping its shape")
    params, overhead = live_forward, None
    if any(math.isfinite(s.execute_seconds) for s in steps):
        overhead = fit_overhead(steps, model_name, tensor_parallel_size)
        params = combine(live_forward, overhead)
        lines.append(format_errors(region_errors(params, steps, "seconds"),
                                   "step fit on the whole engine steps, per region", "region"))
    for name, samples in live.items():
        target = "execute_seconds" if name in micro_names else "seconds"
        error = fit_errors(params if target == "seconds" else forward, samples, target)[-1]
        lines.append(f"  {name}: {error.count} steps, MAPE {error.mape:.1f}%, total "
                     f"{100 * (error.predicted_s / error.measured_s - 1):+.1f}%")
    if dropped:
        lines.append(f"  {len(dropped)} outlier timing(s) left out of the forward fit (slowed "
                     "down by other work on the host)")
    params = replace(params, fit_error=_fit_error_of(params, forward, micro, steps))
    return Calibration(params, [*micro, *steps], forward, overhead, seconds_per_swap_block,
                       "\n".join(lines))


def _fit_at_one_speed(live: Mapping[str, Sequence[StepSample]], weights: Sequence[float],
                      micro_names: set[str], model: str, tensor_parallel_size: int,
                      rounds: int = 4) -> tuple[FittedParams, list[StepSample], dict[str, float]]:
    """``fit_trimmed`` over every source brought to one speed: each source of whole steps is
    divided by its ``forward_level`` against the fit (the micro-benchmarks, when there are any,
    set the speed; else the median source), and the fit repeated. Returns the fit at that speed,
    the outliers and each source's level."""
    levels = dict.fromkeys(live, 1.0)
    for _ in range(rounds):
        pooled = [StepSample(s.aggregates, s.seconds / levels[name], s.execute_seconds / levels[name],
                             s.kind, lora_features=s.lora_features)
                  for name, samples in live.items() for s in samples]
        forward, dropped = fit_trimmed(pooled, weights, model, tensor_parallel_size)
        measured = {name: forward_level(forward, samples) for name, samples in live.items()}
        grid = [s for name, samples in live.items() if name in micro_names for s in samples]
        reference = (forward_level(forward, grid) if grid else
                     statistics.median(v for v in measured.values() if math.isfinite(v)))
        levels = {name: 1.0 if name in micro_names or not math.isfinite(v) else v / reference
                  for name, v in measured.items()}
    return forward, dropped, levels


def forward_level(params: FittedParams, samples: Iterable[StepSample]) -> float:
    """Measured over predicted forward-pass seconds of the steps that timed it (``nan`` when
    none did): how much slower a live engine's forward passes run than back-to-back ones."""
    measured = predicted = 0.0
    for s in samples:
        if math.isfinite(s.execute_seconds) and _fittable(s, "execute_seconds"):
            measured += s.execute_seconds
            predicted += predict_sample(params, s)
    return measured / predicted if predicted > 0 else math.nan


def _fit_error_of(params: FittedParams, forward: FittedParams, micro: Sequence[StepSample],
                  steps: Sequence[StepSample]) -> dict[str, float]:
    """The stated error (``FittedParams.fit_error``): per step kind, of the whole-step fit on
    the whole steps where there are any, else of the forward fit on the micro-benchmarks; and
    ``micro_mape``/``micro_max``, the forward fit's on the micro-benchmarks."""
    errors = (fit_errors(params, steps, "seconds") if steps
              else fit_errors(forward, micro, "execute_seconds"))
    if micro:
        errors.append(replace(fit_errors(forward, micro, "execute_seconds")[-1], kind="micro"))
    out: dict[str, float] = {}
    for e in errors:
        out[f"{e.kind}_mape"] = round(e.mape, 2)
        out[f"{e.kind}_max"] = round(e.max_ape, 2)
    return out


def fit_backend(micro: Sequence[StepSample], loop: Sequence[StepSample], model_name: str,
                seconds_per_swap_block: float | None = None,
                lora: Sequence[StepSample] = (), tensor_parallel_size: int = 1,
                runs: Mapping[str, Sequence[StepSample]] | None = None) -> Calibration:
    """``fit_joint`` of a backend measurement: the micro-benchmarks, the LoRA steps
    (``gpu.profiler.measure_lora``, whose features give the fit its LoRA coefficients), the
    engine loop's steps and, when given, the steps of real runs (by name)."""
    sources: dict[str, Sequence[StepSample]] = {"micro": micro, "lora": lora, "loop": loop}
    sources.update(runs or {})
    cal = fit_joint(sources, model_name, ("micro", "lora"), tensor_parallel_size,
                    seconds_per_swap_block)
    if lora:
        cal.report += "\n" + format_errors(
            fit_errors(cal.forward or cal.params, lora, "execute_seconds"),
            "forward-pass fit on the LoRA steps (adapters loaded or resident)")
    return cal


def calibrate_from_runs(run_dirs: Sequence[str | Path], model_name: str,
                        tensor_parallel_size: int = 1,
                        backend_samples: Sequence[StepSample] = ()) -> Calibration:
    """A fit on the recorded steps of real runs.

    With ``backend_samples`` (a backend calibration's ``--samples-out``: micro-benchmarks and
    engine-loop steps over the whole step space) the runs join them in one ``fit_backend``, so
    the profile stays good for workloads unlike the runs. Without, absolute least squares over
    the runs' steps alone, at the median run's speed (``fit_runs``): the most faithful on those
    runs' own batch sizes and contexts, but extrapolated anywhere else."""
    runs = [read_samples(d) for d in run_dirs]
    samples = [s for run in runs for s in run]
    if backend_samples:
        micro, loop = split_backend_samples(backend_samples)
        named = {f"run {i + 1}": run for i, run in enumerate(runs)}  # in --from-run order
        cal = fit_backend(micro, loop, model_name, tensor_parallel_size=tensor_parallel_size,
                          runs=named)
        speeds = [run_speed(cal.params, run) for run in runs]
        cal.report += ("\nrun speed, measured over fitted step time: "
                       + " ".join(f"{v:.2f}" for v in speeds))
        return cal
    params, speeds = fit_runs(runs, model_name, tensor_parallel_size)
    report = format_errors(region_errors(params, samples, "seconds"),
                           f"step fit on {len(samples)} recorded steps of {len(run_dirs)} run(s), "
                           "per region", "region")
    if len(runs) > 1:
        report += ("\nrun speed, measured over fitted step time (the fit is at the median run's): "
                   + " ".join(f"{v:.2f}" for v in speeds))
    report += ("\nfitted on the runs' steps alone: regions the runs never reached are "
               "extrapolated (pass --backend-samples for a profile good for any workload)")
    return Calibration(params, samples, report=report)


def save_profile(cal: Calibration, model: str, base_hardware: str, out: str | Path,
                 block_size: int = 16, note: str = "", platform: Platform | None = None,
                 interconnect: tuple[float, float] | None = None,
                 kernel_settings: KernelSettings | None = None,
                 step_space: Mapping[str, int] | None = None) -> Path:
    """The base profile + ``cal.params`` (+ the measured swap bandwidth) written to ``out``.
    ``platform``: the measured device, whose type and bf16 support the profile then records,
    so the twin resolves the engine arguments as the real engine did there.
    ``kernel_settings``: the kernels the measured steps ran, recorded in the fit
    (``core.kernel_settings.kernel_settings_mismatch`` compares them with an engine's).
    ``step_space``: the limits the measured steps spanned (``FittedParams.beyond``)."""
    params = cal.params if kernel_settings is None else replace(
        cal.params, kernel_settings=kernel_settings.to_dict())
    if step_space is not None:
        params = replace(params, step_space=dict(step_space))
    base = load_hardware(base_hardware)
    if platform is not None:
        base = replace(base, device_type=platform.device_type, native_bf16=platform.native_bf16)
    if interconnect is not None:  # the measured all-reduce (bandwidth B/s, latency s)
        base = replace(base, interconnect_bandwidth=interconnect[0],
                       interconnect_latency_s=interconnect[1], interconnect_fit_error={},
                       interconnect_source="measured by twinserve calibrate on this machine")
    pcie = None
    if cal.seconds_per_swap_block:
        # the simulator times a swap as spec block bytes / pcie_bandwidth: match the measurement
        block_bytes = CostModel(load_model_spec(model), base, cal.params.tensor_parallel_size,
                                block_size).block_bytes()
        pcie = block_bytes / cal.seconds_per_swap_block
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    name = base.name if base.name.endswith("-calibrated") else f"{base.name}-calibrated"
    profile = calibrated_profile(base, params, pcie, name=name, note=note)
    return profile.save(out)


def runs_kernel_settings(run_dirs: Sequence[str | Path]) -> KernelSettings | None:
    """The kernel settings every run's ``config.json`` records, or None when a run records none
    (a run of an older twinserve, or steps without a config); ValueError when the runs ran
    different kernels."""
    found = set()
    for run_dir in run_dirs:
        path = Path(run_dir) / "config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text(encoding="utf-8"))
        if not all(name in config for name in KernelSettings.field_names()):
            return None
        found.add(KernelSettings.from_mapping(config))
    if len(found) > 1:
        raise ValueError("the runs ran different kernel settings ("
                         + "; ".join(sorted(map(str, found))) + "): fit runs of one setting.")
    return found.pop() if found else None


def predicted_seconds(samples: Iterable[StepSample], model: str, profile: str | Path,
                      block_size: int, tensor_parallel_size: int = 1) -> float:
    """The total seconds the profile's cost model gives the very steps of ``samples`` (what
    ``validate`` sets against their measured total)."""
    cost = make_cost_model(load_model_spec(model), load_hardware(profile), tensor_parallel_size,
                           block_size)
    return sum(cost.step_time(output_of(s.aggregates)) for s in samples)
