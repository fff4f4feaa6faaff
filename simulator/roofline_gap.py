"""How far the plain roofline fell short where it was set against measured step times, for the
runs that rest on nothing else.

A run whose profile holds no fit for its model and TP size times its steps with the roofline's
assumed efficiencies. Its figures carry no error bar of their own, so the run says how far the
roofline landed on the two measurements bundled with the project: Vidur's operator profiles of
Llama-3-8B on an A100-80GB (vLLM-class kernels, ``data/profiles/vidur``) and twinserve's own
engine running Llama-3-8B on an H200 (``data/profiles/twinserve``). The figures below are kept as
constants so that a simulation reads no data; ``measure_gaps`` recomputes them from the bundled
data (``python -m twinserve.simulator.roofline_gap``) and a test holds the two together.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

STEP_KINDS = ("decode", "prefill", "mixed")


@dataclass(slots=True, frozen=True)
class KindGap:
    """How much shorter the roofline's step time was than the measured one, in % of the measured
    (``100 * (1 - roofline / measured)``), over ``steps`` steps of one kind."""

    kind: str
    steps: int
    low_pct: float
    median_pct: float
    high_pct: float

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"kind must be one of {STEP_KINDS}, got {self.kind!r}.")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps!r}.")
        if not self.low_pct <= self.median_pct <= self.high_pct:
            raise ValueError("low_pct <= median_pct <= high_pct must hold, got "
                             f"{self.low_pct}, {self.median_pct}, {self.high_pct}.")

    def describe(self) -> str:
        return (f"{self.kind} {self.low_pct:.0f}-{self.high_pct:.0f}% "
                f"(median {self.median_pct:.0f}%)")


@dataclass(slots=True, frozen=True)
class RooflineGap:
    """The roofline of one bundled GPU profile against one bundled measurement of a model."""

    hardware: str
    model: str
    measured: str  # what ran and who measured it
    data: str  # where the measurement lies in the repository
    kinds: tuple[KindGap, ...]

    def describe(self) -> str:
        return (f"{self.hardware} / {self.model}, {self.measured} ({self.data}): "
                + ", ".join(k.describe() for k in self.kinds))


# Recomputed by ``measure_gaps`` (tests/simulator/test_roofline_gap.py keeps them equal).
ROOFLINE_GAPS: tuple[RooflineGap, ...] = (
    RooflineGap("a100-80gb", "llama-3-8b", "Vidur's operator profiles",
                "simulator/data/profiles/vidur",
                (KindGap("decode", 167, 5.2, 19.8, 27.1), KindGap("prefill", 115, 24.2, 34.2, 42.6),
                 KindGap("mixed", 70, 4.0, 30.8, 43.9))),
    RooflineGap("h200", "llama-3-8b", "twinserve's own engine",
                "simulator/data/profiles/twinserve",
                (KindGap("decode", 186, 20.5, 43.0, 65.2), KindGap("prefill", 42, 20.8, 76.9, 82.2),
                 KindGap("mixed", 39, 42.5, 76.0, 81.7))),
)
REPRODUCE = "python -m twinserve.simulator.roofline_gap"


def roofline_caveat(gaps: tuple[RooflineGap, ...] = ROOFLINE_GAPS) -> str:
    """The line a roofline-only run prints and records (``config.json``'s ``roofline_gap``)."""
    return ("roofline only (no measured fit): where a roofline was set against measured steps, "
            "its steps were shorter than measured, so read latencies as optimistic: "
            + "; ".join(g.describe() for g in gaps)
            + f" ({REPRODUCE}). A profile with a fit (--hardware a100-80gb for Llama-3-8B) or "
            "`twinserve calibrate` on the GPU puts a run on measured ground.")


def _kind_gaps(pairs: list[tuple[str, float, float]]) -> tuple[KindGap, ...]:
    """``(kind, measured_s, roofline_s)`` per step -> one ``KindGap`` per kind present."""
    by_kind: dict[str, list[float]] = {}
    for kind, measured, roofline in pairs:
        by_kind.setdefault(kind, []).append(100.0 * (1.0 - roofline / measured))
    return tuple(KindGap(k, len(v), round(min(v), 1), round(statistics.median(v), 1),
                         round(max(v), 1)) for k in STEP_KINDS if (v := by_kind.get(k)))


def measure_gaps() -> tuple[RooflineGap, ...]:
    """``ROOFLINE_GAPS`` recomputed from the bundled data: every Vidur step of Llama-3-8B at TP 1
    on the A100-80GB, and every step of the H200 grid (its forward passes, which the roofline
    models; the engine loop's steps add host time it does not)."""
    from twinserve.core.step_sample import step_kind
    from twinserve.simulator.calibration import output_of
    from twinserve.simulator.cost_model import CostModel
    from twinserve.simulator.hardware import load_hardware
    from twinserve.simulator.measured_profiles import MeasuredProfile
    from twinserve.simulator.model_spec import load_model_spec
    from twinserve.simulator.vidur_profiles import DATASETS, operator_samples

    def roofline(hardware: str, model: str) -> CostModel:
        return CostModel(load_model_spec(model), replace(load_hardware(hardware), fitted=()))

    a100 = next(d for d in DATASETS if d.hardware == "a100-80gb" and "llama-3-8b" in d.models)
    data, cost = operator_samples(a100, 1), roofline("a100-80gb", "llama-3-8b")
    vidur = [(step.kind, sample.seconds, cost.step_time(output_of(step.aggregates())))
             for step, sample in zip(data.steps, data.samples)]
    h200, cost = MeasuredProfile.load("h200", "llama-3-8b"), roofline("h200", "llama-3-8b")
    own = [(step_kind(s.aggregates), s.execute_seconds, cost.step_time(output_of(s.aggregates)))
           for s in h200.micro]
    return tuple(replace(gap, kinds=_kind_gaps(pairs))
                 for gap, pairs in zip(ROOFLINE_GAPS, (vidur, own)))


if __name__ == "__main__":
    for gap in measure_gaps():
        print(gap.describe())
