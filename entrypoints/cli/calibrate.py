"""``twinserve calibrate``: measure the real backend, fit the simulator's step time, write a profile.

    twinserve calibrate --model DIR [--device cpu|cuda] [--dtype D] --out PROFILE.json \\
        [--base-hardware NAME] [--profile-model NAME] [--quick] [--max-num-batched-tokens N]
    twinserve calibrate --from-run RUN_DIR [RUN_DIR ...] --out PROFILE.json [--model DIR]

From the backend (default): micro-benchmarks of ``ModelRunner.execute`` on hand-built steps
(prefill chunks after cached prefixes, decode batches, decodes + a prefill chunk; median of
repeats) plus synthetic workloads through the real engine loop, which time the whole step
(scheduling, sampling, output processing) beside the forward pass. The forward pass is fitted on
every forward timing (relative error), the loop overhead (step minus forward) on the loop's steps;
the profile holds their sum. Swap copies are timed too and set the profile's ``pcie_bandwidth``.

The default grid covers the engine's space: prefill chunks of 16 tokens up to the batch budget
(several prompts' chunks where the budget exceeds the model length), after cached prefixes;
decode batches of 1 to ``max_num_seqs`` at contexts up to the model length (2k on the CPU, 4k on
a GPU), equal and spread; decodes with a prefill chunk. Timed in a shuffled order, and fitted
with outliers left out, so that a burst of other work on a shared host does not bend the fit.
The report gives the fit's error per region of that space (decode batch x context, prefill
tokens fresh or after a cached prefix, mixed steps), the profile is good for any workload.

From runs (``--from-run``): the per-step samples ``validate`` records in ``RUN/step_features.csv``
(every real step's aggregates and measured seconds). With ``--backend-samples CSV`` (the
``--samples-out`` of a backend calibration) they join the micro-benchmarks and engine-loop steps
in one fit, each source weighing the same: the runs correct the machine's speed and loop costs,
the grid keeps the regions the runs never reached. Without, they are fitted alone by absolute
least squares so the predicted total of the run's step times equals the measured one: the most
faithful on those runs' own steps, extrapolated elsewhere (the report says so). Several runs
are fitted at the median run's speed: on a shared host whole runs go faster or slower, and the
report lists each run's speed against the fit.
To refine a backend calibration, pass it as the base: ``--from-run RUN --base-hardware OLD.json``
keeps its measured swap bandwidth and other fits and replaces this model's fit.

The profile is the base profile's roofline numbers with a ``fitted`` entry for this model (its
directory name, as ``load_model_spec`` names it, or ``--profile-model``) at TP 1; ``twinserve
simulate --hardware PROFILE.json --model DIR`` picks it up. The format is the same on every
device. On a GPU (``--device cuda``) the base is the bundled profile of the GPU's name (h200,
h100-sxm, a100-80gb, a100-40gb) and the grid reaches 8k-token prefill chunks and 4k-token decode
contexts; a random-weight model of a bundled shape stands for the real one, e.g.
``python -m twinserve.benchmarks.random_model --config llama-3-8b --device cuda --out DIR`` then
``twinserve calibrate --device cuda --dtype bfloat16 --model DIR --profile-model llama-3-8b
--out h200-calibrated.json`` (``benchmarks/cuda_check.sh`` runs it).
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from twinserve.fidelity.backend import (
    Log,
    base_hardware_for,
    measure_interconnect,
    model_dir_or_default,
)
from twinserve.fidelity.settings import CalibrationSettings
from twinserve.fidelity.threads import measurement_threads, set_threads

if TYPE_CHECKING:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.fidelity.calibration import CalibrationResult
    from twinserve.gpu.worker.model_runner import ModelRunner

# (names other commands import from here: the fidelity API's)
__all__ = ["Log", "add_calibration_flags", "add_parser", "base_hardware_for",
           "calibration_settings", "engine_of", "load_runner", "measure_interconnect", "measurement_threads",
           "model_dir_or_default", "run_calibrate", "set_threads"]


def engine_of(args: argparse.Namespace) -> EngineArgs:
    """The engine the flags describe (resolved as a server's), naming its model."""
    from twinserve.entrypoints.engine_args import engine_args_from
    return engine_args_from(args, model=model_dir_or_default(args.model))


def load_runner(args: argparse.Namespace,
                weights_from: ModelRunner | None = None) -> tuple[EngineArgs, ModelRunner]:
    """The ``EngineArgs`` and a loaded ``ModelRunner`` for the engine flags in ``args``
    (``fidelity.backend.load_runner``)."""
    from twinserve.fidelity.backend import load_runner as load
    engine = engine_of(args)
    return engine, load(engine, weights_from)


def calibration_settings(args: argparse.Namespace) -> CalibrationSettings:
    """The calibration flags (``add_calibration_flags``) as settings."""
    return CalibrationSettings(args.quick, args.warmup, args.repeats, args.engine_loop,
                               args.threads, args.base_hardware, args.profile_model)


def add_calibration_flags(p: argparse.ArgumentParser) -> None:
    threads = measurement_threads()
    g = p.add_argument_group("calibration")
    g.add_argument("--base-hardware", default=None,
                   help="profile whose roofline numbers the calibrated profile keeps (default: cpu "
                        "on the CPU, the bundled profile of the GPU's name on CUDA, e.g. h200)")
    g.add_argument("--profile-model", default=None, metavar="NAME",
                   help="the model name the fit is stored under (default: the model directory's "
                        "name); e.g. llama-3-8b for a random-weight model of that shape")
    g.add_argument("--quick", action="store_true", help="a smaller grid and fewer workloads")
    g.add_argument("--warmup", type=int, default=1, help="untimed runs per benchmark step")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per step (median)")
    g.add_argument("--no-engine-loop", dest="engine_loop", action="store_false",
                   help="micro-benchmarks only (no scheduling/sampling overhead measured)")
    g.add_argument("--threads", type=int, default=threads,
                   help="torch CPU threads (default: every core but one, here "
                        f"{threads}: fidelity.measurement_threads; the CPU only)")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from twinserve.entrypoints.engine_args import add_engine_args
    p = sub.add_parser("calibrate", help="fit the simulator's step time to the real backend",
                       description=__doc__.split("\n\n", 1)[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default=None, help="HF model directory (default: bundled model)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--from-run", nargs="+", default=None, metavar="RUN_DIR",
                   help="fit from the steps recorded by validate in these real run folders")
    p.add_argument("--samples-out", default=None, help="also write the samples as CSV")
    p.add_argument("--backend-samples", default=None, metavar="CSV",
                   help="with --from-run: a backend calibration's --samples-out, fitted jointly "
                        "with the runs' steps (a profile good for any workload, not only theirs)")
    p.add_argument("--relevel", default=None, metavar="PROFILE",
                   help="time the host-speed probe now and write PROFILE with every fit scaled "
                        "to the host's speed now (seconds, where a calibration takes minutes)")
    add_engine_args(p)
    add_calibration_flags(p)
    p.set_defaults(handler=run_calibrate)


def _log_stderr(msg: str) -> None:
    import sys
    print(msg, file=sys.stderr, flush=True)


def run_calibrate(args: argparse.Namespace) -> int:
    """``twinserve calibrate``: the flags as the fidelity API's settings, then
    ``fidelity.relevel``, ``fidelity.calibrate_from_runs`` or ``fidelity.calibrate``."""
    from twinserve import fidelity
    if args.relevel:
        if args.from_run:
            raise ValueError("--relevel and --from-run exclude each other.")
        path, factor = fidelity.relevel(args.relevel, engine_of(args), args.out,
                                        calibration_settings(args))
        print(f"host speed: the probe's steps take {factor:.3f}x their time at calibration; "
              f"profile written: {path}")
        return 0
    if args.backend_samples and not args.from_run:
        raise ValueError("--backend-samples joins a backend calibration's samples to --from-run "
                         "runs: give --from-run too.")
    if args.from_run:
        result = fidelity.calibrate_from_runs(
            args.from_run, args.out, args.model, args.profile_model, args.tensor_parallel_size,
            args.backend_samples, args.base_hardware, args.block_size)
    else:
        result = fidelity.calibrate(engine_of(args), args.out, calibration_settings(args),
                                    log=_log_stderr)
    return _report(result, args.samples_out)


def _report(result: CalibrationResult, samples_out: str | None) -> int:
    from twinserve.core.step_sample import write_samples
    cal = result.calibration
    if samples_out:
        write_samples(samples_out, cal.samples)
    print(cal.report)
    p = cal.params
    coefs = ", ".join(f"{k}={v:.3g}" for k, v in p.coefficients.items() if v)
    print(f"fitted: intercept {p.intercept_s * 1e3:.2f} ms; {coefs or 'no coefficient'}")
    print(f"profile written: {result.profile} (use: twinserve simulate --hardware "
          f"{result.profile} --model {result.model})")
    return 0 if all(math.isfinite(v) for v in p.coefficients.values()) else 1
