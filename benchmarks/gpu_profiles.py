"""The calibrated GPU profiles against the measurements they rest on (Vidur's operator profiles,
and twinserve's own GPU calibrations: ``simulator/measured_profiles.py``).

    python -m twinserve.benchmarks.gpu_profiles

First a summary: the fit error of every fitted entry per profile, model, TP size and step kind
(prefill, decode, mixed), and which operators it rests on (measured, or the roofline's attention
where Vidur's attention profile was not obtainable). Then, per entry, the error per step kind and
batch-size band, and (``--detail``: at every TP size; by default TP 1 and 2) a table of step times
at representative points: the data's (Vidur's composition of its measured operators; with the
roofline's attention where none was measured), twinserve's with the calibrated profile and
twinserve's plain roofline (the profile without its fit: what every run used before). Where
attention was measured, how far roofline attention in its place lands (the bias of the fits that
rest on it). Then the all-reduce fit of each node (the profiles' link terms) by size band and GPU
count. Last, each fit that rests on twinserve's own measurements (the H200): its error per region
of the step space, measured against fitted against roofline step times, and an earlier
calibration's fit beside it. Needs scipy (the fits are redone here to report them); the
simulator itself only reads the stored fits.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from twinserve.simulator.calibration import output_of
from twinserve.simulator.cost_model import CostModel, make_cost_model
from twinserve.simulator.hardware import FittedParams, load_hardware
from twinserve.simulator.measured_profiles import bundled_measurements
from twinserve.simulator.measured_profiles import report as measured_report
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.vidur_profiles import (
    NETWORKS,
    VIDUR_DIR,
    DatasetSamples,
    OperatorStep,
    RooflineAttentionStep,
    all_samples,
    fit_dataset,
    format_all_reduce,
    format_fit,
    load_mlp,
)

TABLE_STEPS = (
    OperatorStep(decode=(1, 1728)), OperatorStep(decode=(8, 1728)), OperatorStep(decode=(32, 1728)),
    OperatorStep(decode=(52, 1728)), OperatorStep(decode=(16, 672)), OperatorStep(decode=(64, 672)),
    OperatorStep(decode=(120, 96)), OperatorStep(decode=(168, 1664)), OperatorStep(decode=(256, 1664)),
    OperatorStep(decode=(344, 1664)), OperatorStep(prefill=(64, 0)), OperatorStep(prefill=(448, 0)),
    OperatorStep(prefill=(448, 4032)), OperatorStep(prefill=(480, 12960)),
    OperatorStep(prefill=(4736, 0)), OperatorStep(prefill=(8192, 8192)),
)
GRID_TABLE_STEPS = (
    OperatorStep(decode=(1, 1024)), OperatorStep(decode=(8, 2048)), OperatorStep(decode=(32, 512)),
    OperatorStep(decode=(64, 2048)), OperatorStep(decode=(256, 1024)), OperatorStep(prefill=(64, 0)),
    OperatorStep(prefill=(512, 0)), OperatorStep(prefill=(2048, 512)), OperatorStep(prefill=(4096, 0)),
)
NUM_MIXED = 4  # decode + prefill pairs of the fit's samples shown besides


def label(step: OperatorStep) -> str:
    parts = []
    if step.decode:
        parts.append(f"{step.decode[0]} dec @ kv {step.decode[1]}")
    if step.prefill:
        parts.append(f"prefill {step.prefill[0]} after {step.prefill[1]}")
    return " + ".join(parts)


def step_table(data: DatasetSamples, steps: Sequence[OperatorStep] | None = None) -> str:
    """Data vs calibrated twin vs plain roofline, in ms, at the given (or representative) steps."""
    ds, tp = data.dataset, data.tensor_parallel_size
    if steps is None:
        steps = TABLE_STEPS if ds.measured_attention(tp) else GRID_TABLE_STEPS
    spec = load_model_spec(ds.models[0])
    hardware = load_hardware(ds.hardware)
    calibrated = make_cost_model(spec, hardware, tp)
    roofline = CostModel(spec, hardware, tp)
    measured = {s: sample.seconds for s, sample in zip(data.steps, data.samples)}
    what = ("Vidur's measured operators" if ds.measured_attention(tp)
            else "Vidur's measured linear operators" + (" and all-reduces" if tp > 1 else "")
            + " + roofline attention")
    lines = [f"{ds.hardware} / {ds.models[0]} / TP {tp}: step time (ms), data = {what}",
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


def roofline_attention_gap(data: DatasetSamples) -> str:
    """Where attention was measured: how far measured linear operators + roofline attention (what
    the fits without attention data rest on) land from the fully measured composition."""
    ds = data.dataset
    timing = RooflineAttentionStep(load_mlp(VIDUR_DIR / ds.mlp_file, data.tensor_parallel_size),
                                   CostModel(load_model_spec(ds.models[0]), load_hardware(ds.hardware),
                                             data.tensor_parallel_size), None)
    by_kind: dict[str, list[float]] = {}
    for step, sample in zip(data.steps, data.samples):
        by_kind.setdefault(step.kind, []).append(100 * (timing.seconds(step) - sample.seconds)
                                                 / sample.seconds)
    lines = [f"{ds.hardware} / {ds.models[0]} / TP {data.tensor_parallel_size}: roofline attention "
             "in place of the measured one (the basis of every fit without attention data), "
             "signed error % against the fully measured steps",
             f"  {'kind':<8} {'steps':>6} {'mean':>7} {'min':>7} {'max':>7}"]
    for kind, errors in by_kind.items():
        lines.append(f"  {kind:<8} {len(errors):>6} {sum(errors) / len(errors):>+7.1f} "
                     f"{min(errors):>+7.1f} {max(errors):>+7.1f}")
    return "\n".join(lines)


def summary_table(fits: Sequence[tuple[DatasetSamples, FittedParams]]) -> str:
    """Fit error (mean / max %) per profile, model, TP size and step kind, and what it rests on."""
    lines = ["fit error per profile, TP size and step kind: MAPE % / max % over the data's steps",
             f"  {'profile':<10} {'model':<12} {'TP':>2} {'steps':>5} {'prefill':>13} {'decode':>13} "
             f"{'mixed':>13} {'all':>13}  attention"]
    for data, params in fits:
        e = params.fit_error
        cells = [f"{e[f'{k}_mape']:>5.1f} / {e[f'{k}_max']:>5.1f}" if f"{k}_mape" in e else f"{'-':>13}"
                 for k in ("prefill", "decode", "mixed", "all")]
        attention = ("measured" if data.dataset.measured_attention(data.tensor_parallel_size)
                     else "roofline")
        lines.append(f"  {data.dataset.hardware:<10} {params.model:<12} {data.tensor_parallel_size:>2} "
                     f"{params.num_samples:>5} {' '.join(cells)}  {attention}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twinserve.benchmarks.gpu_profiles",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--detail", action="store_true",
                        help="the step tables at every TP size (by default TP 1 and 2)")
    args = parser.parse_args(argv)
    fits = [(data, fit_dataset(data, data.dataset.models[0])) for data in all_samples()]
    print(summary_table(fits))
    print()
    for data, params in fits:
        print(format_fit(params, data))
        print()
        if args.detail or data.tensor_parallel_size <= 2:
            print(step_table(data))
            print()
    for data, _ in fits:
        if data.dataset.measured_attention(data.tensor_parallel_size):
            print(roofline_attention_gap(data))
            print()
    for network in NETWORKS:
        print(format_all_reduce(network))
        print()
    for hardware, model in bundled_measurements():
        print(measured_report(hardware, model))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
