"""The bundled GPU fits that rest on twinserve's own measurements (``data/profiles/twinserve``):
the samples ``twinserve calibrate --device cuda --samples-out`` wrote on a real GPU, beside the
fit the bundled hardware profile holds, and the report of one against the other.

A file ``<hardware>_<model>.csv`` holds the calibration whose fit is bundled; a file
``<hardware>_<model>_earlier.csv`` an earlier calibration on the same machine, whose fit shows
how far two calibrations differ. PROVENANCE.md beside them says how each was measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from twinserve.core.step_sample import StepSample, read_samples
from twinserve.simulator.calibration import (
    fit_backend,
    fit_errors,
    format_errors,
    output_of,
    predict_sample,
    region_errors,
    split_backend_samples,
)
from twinserve.simulator.cost_model import make_cost_model
from twinserve.simulator.hardware import FittedParams, load_hardware
from twinserve.simulator.model_spec import load_model_spec

MEASURED_DIR = Path(__file__).resolve().parent / "data" / "profiles" / "twinserve"
# (decodes, context) and prefill tokens shown in the step table
TABLE_DECODES = ((1, 512), (1, 4096), (8, 512), (64, 512), (64, 4096), (256, 512))
TABLE_PREFILLS = (16, 128, 512, 1024, 2048, 8192)


@dataclass(slots=True, frozen=True)
class MeasuredProfile:
    """One bundled measurement: its samples split into the grid and the engine loop, and the
    fit the bundled hardware profile holds for it."""

    hardware: str
    model: str
    micro: list[StepSample]
    loop: list[StepSample]
    params: FittedParams

    @classmethod
    def load(cls, hardware: str, model: str) -> MeasuredProfile:
        micro, loop = split_backend_samples(read_samples(MEASURED_DIR / f"{hardware}_{model}.csv"))
        params = load_hardware(hardware).find_fitted(model, 1)
        if params is None:
            raise ValueError(f"the bundled {hardware} profile holds no fit for {model} at TP 1.")
        return cls(hardware, model, micro, loop, params)


def bundled_measurements() -> list[tuple[str, str]]:
    """``(hardware, model)`` of every bundled measurement."""
    stems = (p.stem for p in MEASURED_DIR.glob("*.csv") if not p.stem.endswith("_earlier"))
    return sorted((hardware, model) for hardware, model in (s.split("_", 1) for s in stems))


def _pick(samples: list[StepSample], decodes: int = 0, context: int = 0,
          prefill: int = 0) -> StepSample | None:
    """The grid's step of ``decodes`` equal contexts, or of one fresh ``prefill`` chunk."""
    for s in samples:
        a = s.aggregates
        if prefill and (a["num_decode_seqs"], a["num_prefill_seqs"], a["num_prefill_tokens"],
                        a["num_prefix_chunks"]) == (0, 1, prefill, 0):
            return s
        if decodes and a["num_prefill_seqs"] == 0 and a["num_decode_seqs"] == decodes and \
                a["sum_decode_context_tokens"] == decodes * context == decodes * a["max_decode_context"]:
            return s
    return None


def step_table(m: MeasuredProfile, forward: FittedParams) -> str:
    """Forward-pass ms at representative grid points: measured, the twin's fit of the grid, and
    the plain roofline of the same GPU (what every run used before the measurement)."""
    roofline = make_cost_model(load_model_spec(m.model), replace(load_hardware(m.hardware), fitted=()))
    lines = [f"{m.hardware} {m.model}: forward pass per step (ms), measured / fitted / roofline",
             f"  {'step':<24} {'measured':>9} {'fitted':>8} {'roofline':>9}"]
    picks = [(f"{d} decodes @ ctx {c}", _pick(m.micro, decodes=d, context=c)) for d, c in TABLE_DECODES]
    picks += [(f"prefill {n}", _pick(m.micro, prefill=n)) for n in TABLE_PREFILLS]
    for name, s in picks:
        if s is not None:
            lines.append(f"  {name:<24} {s.execute_seconds * 1e3:>9.2f} "
                         f"{predict_sample(forward, s) * 1e3:>8.2f} "
                         f"{roofline.step_time(output_of(s.aggregates)) * 1e3:>9.2f}")
    return "\n".join(lines)


def report(hardware: str, model: str) -> str:
    """The bundled fit's error per region of the engine loop's steps, the grid's forward fit per
    region, the step table and, where an earlier calibration is bundled, how far its fit lands."""
    m = MeasuredProfile.load(hardware, model)
    refit = fit_backend(m.micro, m.loop, model)
    forward = refit.forward or refit.params
    parts = [f"{hardware} {model}: {m.params.source}",
             format_errors(region_errors(m.params, m.loop, "seconds"),
                           "the bundled fit on the engine loop's whole steps, per region", "region"),
             format_errors(region_errors(forward, m.micro, "execute_seconds"),
                           "its forward-pass fit on the grid (ModelRunner.execute), per region",
                           "region"),
             step_table(m, forward)]
    earlier = MEASURED_DIR / f"{hardware}_{model}_earlier.csv"
    if earlier.is_file():
        other = fit_backend(*split_backend_samples(read_samples(earlier)), model)
        ratios = [predict_sample(other.params, s) / predict_sample(m.params, s) for s in m.loop]
        error = fit_errors(other.params, m.loop, "seconds")[-1]
        parts.append(f"an earlier calibration on the same machine ({earlier.name}): its fit over "
                     f"the bundled one on these steps, median {statistics.median(ratios):.3f}x "
                     f"(min {min(ratios):.3f}, max {max(ratios):.3f}); its error on them "
                     f"{error.mape:.1f}% (MAPE)")
    return "\n\n".join(parts)
