"""The calibrated GPU profiles against the measurements they rest on (Vidur's operator profiles).

    python -m twinserve.benchmarks.gpu_profiles

For each calibrated profile (``simulator.vidur_profiles.DATASETS``): the fit error by step kind and
batch size over every measured step, then a table of step times at representative measured points:
the data's (Vidur's composition of its measured operators), twinserve's with the calibrated profile
and twinserve's plain roofline (the profile without its fit: what every run used before). Needs
scipy (the fit is redone here to report it); the simulator itself only reads the stored fit.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from twinserve.simulator.calibration import output_of
from twinserve.simulator.cost_model import CostModel, make_cost_model
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.vidur_profiles import (
    DATASETS,
    DatasetSamples,
    OperatorStep,
    fit_dataset,
    format_fit,
    operator_samples,
)

TABLE_STEPS = (
    OperatorStep(decode=(1, 1728)), OperatorStep(decode=(8, 1728)), OperatorStep(decode=(32, 1728)),
    OperatorStep(decode=(52, 1728)), OperatorStep(decode=(16, 672)), OperatorStep(decode=(64, 672)),
    OperatorStep(decode=(120, 96)), OperatorStep(decode=(168, 1664)), OperatorStep(decode=(256, 1664)),
    OperatorStep(decode=(344, 1664)), OperatorStep(prefill=(64, 0)), OperatorStep(prefill=(448, 0)),
    OperatorStep(prefill=(448, 4032)), OperatorStep(prefill=(480, 12960)),
    OperatorStep(prefill=(4736, 0)), OperatorStep(prefill=(8192, 8192)),
)
NUM_MIXED = 4  # decode + prefill pairs of the fit's samples shown besides


def label(step: OperatorStep) -> str:
    parts = []
    if step.decode:
        parts.append(f"{step.decode[0]} dec @ kv {step.decode[1]}")
    if step.prefill:
        parts.append(f"prefill {step.prefill[0]} after {step.prefill[1]}")
    return " + ".join(parts)


def step_table(data: DatasetSamples, steps: Sequence[OperatorStep] = TABLE_STEPS) -> str:
    """Data vs calibrated twin vs plain roofline, in ms, at the given measured steps."""
    ds = data.dataset
    spec = load_model_spec(ds.models[0])
    hardware = load_hardware(ds.hardware)
    calibrated = make_cost_model(spec, hardware)
    roofline = CostModel(spec, hardware)
    measured = {s: sample.seconds for s, sample in zip(data.steps, data.samples)}
    lines = [f"{ds.hardware} / {ds.models[0]}: step time (ms), data = Vidur's measured operators",
             f"  {'step':<40} {'data':>8} {'twin':>8} {'err %':>7} {'roofline':>9} {'err %':>7}"]
    mixed = [s for s in data.steps if s.kind == "mixed"]
    for step in [*steps, *mixed[:: max(1, len(mixed) // NUM_MIXED)]]:
        if step not in measured:
            continue
        y = measured[step]
        out = output_of(step.aggregates())
        twin, roof = calibrated.step_time(out), roofline.step_time(out)
        lines.append(f"  {label(step):<40} {y * 1e3:>8.2f} {twin * 1e3:>8.2f} "
                     f"{100 * (twin - y) / y:>+7.1f} {roof * 1e3:>9.2f} {100 * (roof - y) / y:>+7.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m twinserve.benchmarks.gpu_profiles",
                            description=__doc__.split("\n\n")[0]).parse_args(argv)
    for ds in DATASETS:
        data = operator_samples(ds)
        print(format_fit(fit_dataset(data, ds.models[0]), data))
        print()
        print(step_table(data))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
