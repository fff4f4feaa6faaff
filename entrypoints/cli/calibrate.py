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
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinserve.gpu.worker.cpu_cores import usable_cores

if TYPE_CHECKING:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.worker.model_runner import ModelRunner

Log = Callable[[str], None]


def _log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure_interconnect(runner: ModelRunner, engine_args: EngineArgs,
                         log: Log | None = None) -> tuple[float, float] | None:
    """With tensor parallelism: the all-reduce timed on this backend at the runner's ranks and
    hidden size, fitted to the profile's (interconnect_bandwidth, interconnect_latency_s)."""
    tp = engine_args.tensor_parallel_size
    if tp < 2 or runner.device.type != "cpu":  # (NCCL across GPUs: not measured here)
        return None
    from twinserve.gpu.distributed.allreduce_benchmark import fit_interconnect, measure_all_reduce
    samples = measure_all_reduce(tp, runner.config.hidden_size, dtype=runner.dtype)
    fit = fit_interconnect(samples)
    if log is not None:
        log(f"all-reduce on {tp} ranks ({len(samples)} sizes): bus bandwidth "
            f"{fit.bandwidth / 1e9:.2f} GB/s, latency {fit.latency_s * 1e6:.0f} us "
            f"(max error {fit.max_relative_error:.0%})")
    return fit.bandwidth, fit.latency_s


def load_runner(args: argparse.Namespace,
                weights_from: ModelRunner | None = None) -> tuple[EngineArgs, ModelRunner]:
    """The ``EngineArgs`` and a loaded ``ModelRunner`` for the engine flags in ``args`` (resolved
    as a server's: calibration and validate measure the engine a server runs); with
    ``weights_from``, on that runner's weights (``ModelRunner``)."""
    from twinserve.entrypoints.engine_args import engine_args_from
    from twinserve.gpu.worker.model_runner import ModelRunner
    eargs = engine_args_from(args, model=args.model)
    return eargs, ModelRunner(eargs, usage_context="server", weights_from=weights_from)


def measurement_threads() -> int:
    """The torch threads the twin's fidelity is measured with (``twinserve demo``, the fidelity
    study): every core the process may use but one (``gpu.cpu_cores``), as vLLM's CPU backend
    leaves one to the host's other work. On a shared 2-core VM two OpenMP threads spin-wait on
    whichever one the hypervisor has set aside: the same steps timed in alternation scattered
    twice as wide on two threads as on one (coefficient of variation 7-10% against 4%), and so
    did whole replays."""
    return max(1, usable_cores() - 1)


def set_threads(threads: int | None) -> None:
    if threads:
        import torch
        torch.set_num_threads(threads)


def model_dir_or_default(model: str | None) -> str:
    if model:
        return model
    from twinserve.gpu.models.default_model import default_model_path
    return str(default_model_path())


def add_calibration_flags(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--threads", type=int, default=2,
                   help="torch CPU threads (default 2; the CPU only)")


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


def _relevel(args: argparse.Namespace) -> int:
    """``--relevel``: the profile at the host's speed now, by its fit's speed probe."""
    from twinserve.gpu.measurement.profiler import speed_probe
    from twinserve.simulator.hardware import load_hardware
    from twinserve.simulator.model_spec import load_model_spec
    profile = load_hardware(args.relevel)
    model = args.model = model_dir_or_default(args.model)
    name = args.profile_model or load_model_spec(model).name
    tp = args.tensor_parallel_size or 1
    fit = profile.find_fitted(name, tp)
    if fit is None:
        raise ValueError(f"--relevel: {args.relevel} holds no fit for {name} at TP {tp}.")
    if args.device != "cuda":
        set_threads(args.threads)
    _, runner = load_runner(args)
    factor = fit.host_speed(speed_probe(runner))
    path = profile.at_host_speed(factor).save(args.out)
    print(f"host speed: the probe's steps take {factor:.3f}x their time at calibration; "
          f"profile written: {path}")
    return 0


def base_hardware_for(device: str | None) -> str:
    """The bundled profile a calibration on ``device`` keeps the roofline numbers of: ``cpu``, or
    on CUDA the profile of the GPU's name (ValueError when none matches: pass --base-hardware)."""
    from twinserve.gpu.worker.platform import current_platform
    from twinserve.simulator.hardware import bundled_profile_for_device
    platform = current_platform(device or "auto")
    if platform.device_type == "cpu":
        return "cpu"
    name = bundled_profile_for_device(platform.device_name)
    if name is None:
        raise ValueError(f"no bundled profile matches the GPU {platform.device_name!r}: pass "
                         "--base-hardware (a bundled name or a profile file) for its peaks.")
    return name


def _model_from_runs(run_dirs: list[str]) -> str | None:
    model = _from_runs(run_dirs, "model")
    return None if model is None else str(model)


def _from_runs(run_dirs: list[str], key: str) -> Any:
    """``key`` of the first run folder's ``config.json`` that has it."""
    for d in run_dirs:
        path = Path(d) / "config.json"
        if path.is_file():
            value = json.loads(path.read_text()).get(key)
            if value:
                return value
    return None


def run_calibrate(args: argparse.Namespace) -> int:
    if args.relevel:
        if args.from_run:
            raise ValueError("--relevel and --from-run exclude each other.")
        return _relevel(args)
    if args.backend_samples and not args.from_run:
        raise ValueError("--backend-samples joins a backend calibration's samples to --from-run "
                         "runs: give --from-run too.")
    from twinserve.core.step_sample import read_samples, write_samples
    from twinserve.gpu.worker.platform import current_platform
    from twinserve.simulator.calibration import calibrate_from_runs, runs_kernel_settings, save_profile
    from twinserve.simulator.hardware import load_hardware
    from twinserve.simulator.model_spec import load_model_spec
    if args.from_run:
        model = args.model or _model_from_runs(args.from_run) or model_dir_or_default(None)
        name = args.profile_model or load_model_spec(model).name
        tp = args.tensor_parallel_size or _from_runs(args.from_run, "tensor_parallel_size") or 1
        backend = read_samples(args.backend_samples) if args.backend_samples else []
        cal = calibrate_from_runs(args.from_run, name, int(tp), backend)
        block_size = args.block_size or 16
        note = f"Calibrated from the steps of {', '.join(map(str, args.from_run))}."
        platform = interconnect = None
        source = f"twinserve calibrate --from-run ({len(args.from_run)} recorded run(s))"
        kernels = runs_kernel_settings(args.from_run)
        base = args.base_hardware or "cpu"
    else:
        model = args.model = model_dir_or_default(args.model)
        name = args.profile_model or load_model_spec(model).name
        base = args.base_hardware or base_hardware_for(args.device)
        load_hardware(base)  # a bad --base-hardware fails now, not after the measurement
        if args.device != "cuda":
            set_threads(args.threads)
        eargs, runner = load_runner(args)
        _log_stderr(f"calibrating {name} on {runner.device} ({runner.dtype}), "
                    f"{runner.num_gpu_blocks} KV blocks")
        from twinserve.entrypoints.cli.interleaved_calibration import InterleavedCalibration
        measurement = InterleavedCalibration(args, eargs, runner, _log_stderr)
        measurement.measure_grid()
        measurement.measure_level()
        cal = measurement.fit(name)
        block_size = eargs.block_size
        platform = current_platform(runner.device)
        interconnect = measure_interconnect(runner, eargs, _log_stderr)
        dtype = str(runner.dtype).removeprefix("torch.")
        device = platform.device_name
        note = f"Calibrated for {name} on {device} {dtype}{' (quick)' if args.quick else ''}."
        source = f"twinserve calibrate on {device} ({dtype}, {len(cal.samples)} steps)"
        kernels = eargs.kernel_settings()
    cal.params = dataclasses.replace(cal.params, source=source)
    path = save_profile(cal, model, base, args.out, block_size, note, platform, interconnect,
                        kernels)
    if not args.from_run:  # constrained decoding's masks (simulator/structured_cost.py)
        from twinserve.entrypoints.cli.structured_calibration import add_mask_timing
        path = add_mask_timing(path, runner, _log_stderr)
    if args.samples_out:
        write_samples(args.samples_out, cal.samples)
    print(cal.report)
    p = cal.params
    coefs = ", ".join(f"{k}={v:.3g}" for k, v in p.coefficients.items() if v)
    print(f"fitted: intercept {p.intercept_s * 1e3:.2f} ms; {coefs or 'no coefficient'}")
    print(f"profile written: {path} (use: twinserve simulate --hardware {path} --model "
          f"{model})")
    return 0 if all(math.isfinite(v) for v in p.coefficients.values()) else 1
