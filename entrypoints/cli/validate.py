"""``twinserve validate``: replay one workload through the real engine and through its twin, and
measure how far the twin lands.

    twinserve validate --model DIR --trace NAME|PATH --policy NAME [trace flags] [engine flags] \\
        [--profile PROFILE.json] --out DIR

1. Real: the engine runs in this process in real time. A driver loop adds each trace request when
   its arrival time has come (prompt ``TraceRequest.prompt_token_ids(vocab)``, greedy,
   ``max_tokens`` = its output length, ``ignore_eos``; tenant and priority from the trace), steps
   while work exists and sleeps until the next arrival when idle (``gpu.replay``). Every step is
   recorded: its ``SchedulerOutput`` aggregates, the whole step's seconds and the forward pass's
   (``OUT/real/step_features.csv``: ``calibrate --from-run`` fits on it).
2. Sim: the same trace through ``simulate`` with the calibrated profile and the real engine's
   settings (its KV block count, batch limits, block size, prefix caching, chunked prefill, policy,
   max_model_len): ``simulator.twin_of_run``.
3. ``OUT/real`` (backend ``twinserve``), ``OUT/sim`` (backend ``sim``), the error table
   ``OUT/errors.csv`` (signed relative error of the twin per metric, with the targets:
   ``reports.fidelity``) and
   ``OUT/report.html``. With ``--real-repeats N`` the real replay runs N times (``OUT/real``,
   ``OUT/real-2``, ...; a fresh scheduler and cache each time) and the twin is compared with the
   median of each metric, the spread of the real runs shown beside it: on a shared machine one
   replay's TPOT can move by a fifth. From 3 runs on, ``OUT/repeatability.csv`` (and a line
   under the table) says how often each real run, set against the others as the twin is, passed
   where the twin is asked to (``reports.repeatability``): the host's floor under the twin's
   error. The row ``replayed_step_time_s`` times the real runs' own
   steps with the profile (measured total vs predicted total): when it is off, the
   step-time model (or the machine's speed since calibration) is to blame, not the scheduling.

Without ``--profile`` the backend is calibrated on the same model load (``twinserve calibrate``'s
grid first, ``--quick`` for a smaller one; its engine-loop workloads, which set the profile's
level, before each replay, so that level is the host's during the replays' minutes) and the
profile saved as ``OUT/profile.json``, the samples it was fitted on as
``OUT/profile_samples.csv`` (``calibrate --from-run ... --backend-samples`` refits them).
``--reuse-real RUN_DIR [RUN_DIR ...]`` skips the real replay and compares against real run
folders written before (same workload flags): handy to try another profile.

The host's speed: a shared VM runs the same steps 15-20% faster or slower an hour apart, which
no profile measured once can know. Each replay is bracketed by the host-speed probe (four fixed
steps, ``gpu.profiler.speed_probe``; ``OUT/real/speed_probe.json``) and, where the profile's fit
recorded the same probe at calibration, the row ``host_speed_vs_profile`` gives the replays'
step time over the calibration's (its error column: what the drift alone does to the twin's
step times). ``--at-host-speed`` simulates with the profile scaled to that speed
(``OUT/profile-at-host-speed.json``): the twin's own error. ``twinserve calibrate --relevel``
rescales a profile the same way, for simulations of the host as it runs now. The probe's few
steps follow the replay's speed only roughly (on one host, correlation 0.79 and 10% apart in
level); the row ``replay_speed_vs_profile`` reads the speed from each replay's own steps (their
measured time over the profile's: ``calibration.run_speed``), and ``--at-replay-speed`` scales
the profile to its median (``OUT/profile-at-replay-speed.json``). That one number taken from the
replays, the rest of the twin's error is its scheduling: batch sizes, queues, preemptions.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinserve.core.step_sample import read_recorded_samples
from twinserve.entrypoints.cli.calibrate import (
    Log,
    add_calibration_flags,
    load_runner,
    model_dir_or_default,
    set_threads,
)
from twinserve.traces import TraceRequest

if TYPE_CHECKING:
    from twinserve.core.step_sample import StepSample
    from twinserve.gpu.worker.model_runner import ModelRunner
    from twinserve.simulator.hardware import FittedParams


# ---- the command ---------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from twinserve.entrypoints.engine_args import add_engine_args
    from twinserve.traces import add_trace_args
    p = sub.add_parser("validate", help="replay a trace on the real engine and its twin; errors",
                       description=__doc__.split("\n\n", 1)[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 1)[1])
    add_trace_args(p)
    p.add_argument("--model", default=None, help="HF model directory (default: bundled model)")
    p.add_argument("--profile", default=None,
                   help="calibrated hardware profile (default: calibrate first)")
    p.add_argument("--reuse-real", nargs="+", default=None, metavar="RUN_DIR",
                   help="compare against these real run folders instead of replaying again")
    p.add_argument("--real-repeats", type=positive_int, default=1, metavar="N",
                   help="replay the real engine N times; compare with the median of each metric")
    speed = p.add_mutually_exclusive_group()
    speed.add_argument("--at-host-speed", action="store_true",
                       help="simulate with the profile scaled to the host's speed during the "
                            "real replays (their speed probe against the profile's): the twin's "
                            "own error, without the host's drift since calibration")
    speed.add_argument("--at-replay-speed", action="store_true",
                       help="simulate with the profile scaled to the replays' own speed (their "
                            "steps' measured time over the profile's, median over the replays): "
                            "the scheduling's error, given the host's speed during the replays")
    p.add_argument("--out", required=True, help="output folder (real/, sim/, errors.csv, ...)")
    p.add_argument("--no-detokenize", dest="detokenize", action="store_false",
                   help="skip incremental detokenization in the real engine")
    p.add_argument("--quiet", action="store_true")
    add_engine_args(p)
    add_calibration_flags(p)
    p.set_defaults(handler=run_validate)


def load_workload(args: argparse.Namespace) -> list[TraceRequest]:
    from twinserve.traces import trace_from_args
    trace = trace_from_args(args)
    if not trace:
        raise ValueError("the workload flags select no request.")
    return trace


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


# ---- the host's speed during the replays ---------------------------------------------------
SPEED_PROBE_FILE = "speed_probe.json"
HOST_SPEED_METRIC = "host_speed_vs_profile"
REPLAY_SPEED_METRIC = "replay_speed_vs_profile"


def write_speed_probe(path: Path, before: dict[str, float], after: dict[str, float]) -> None:
    """The probe's step times before and after a replay, beside the run it brackets."""
    path.write_text(json.dumps({"before": before, "after": after}, indent=1) + "\n")


def profile_fit(profile: str | Path, model: str,
                tensor_parallel_size: int = 1) -> FittedParams | None:
    """The profile's fit for ``model`` at ``tensor_parallel_size`` (None: it holds none)."""
    from twinserve.simulator.hardware import load_hardware
    from twinserve.simulator.model_spec import load_model_spec
    return load_hardware(profile).find_fitted(load_model_spec(model).name, tensor_parallel_size)


def host_speeds(real_dirs: list[Path], fit: FittedParams | None) -> list[float]:
    """Per real run that recorded a speed probe: its steps' time over their time at the
    calibration of ``fit`` (``FittedParams.host_speed`` of the mean of before and after); empty
    when no run has a probe or there is no fit holding one."""
    if fit is None or not fit.speed_probe:
        return []
    speeds = []
    for d in real_dirs:
        if (d / SPEED_PROBE_FILE).is_file():
            data = json.loads((d / SPEED_PROBE_FILE).read_text())
            before, after = data["before"], data["after"]
            speeds.append(fit.host_speed({k: (before[k] + after[k]) / 2 for k in before}))
    return speeds


_NO_SPEED = {
    "host": "--at-host-speed needs real runs with a speed probe (replayed by this version of "
            "validate) and a profile whose fit holds one (calibrated by this version).",
    "replay": "--at-replay-speed needs a profile with a fit for the model and real runs that "
              "recorded their steps (step_features.csv).",
}


def at_speed(profile: str | Path, speeds: list[float], which: str, out: Path) -> Path:
    """``profile`` scaled to the median of the replays' ``which`` speeds (``host``: by their
    probe; ``replay``: by their own steps), written to ``out``."""
    from twinserve.simulator.hardware import load_hardware
    if not speeds:
        raise ValueError(_NO_SPEED[which])
    return load_hardware(profile).at_host_speed(statistics.median(speeds)).save(out)


def replay_speeds(runs: list[list[StepSample]], fit: FittedParams | None) -> list[float]:
    """Per real run (its recorded steps): their measured time over ``fit``'s time for the same
    steps (``calibration.run_speed``), the host's speed read from the replay itself; empty
    without a fit."""
    from twinserve.simulator.calibration import run_speed
    if fit is None:
        return []
    return [v for v in (run_speed(fit, steps) for steps in runs) if math.isfinite(v)]


def real_runs(args: argparse.Namespace, trace: list[TraceRequest], desc: dict[str, Any],
              out: Path, model: str, log: Log,
              weights_from: ModelRunner | None = None) -> tuple[list[Path], str | Path]:
    """The real replays (``--real-repeats`` of them, on ``weights_from``'s weights when given)
    and the profile (calibrated when not given, the engine loop before each replay:
    ``InterleavedCalibration``)."""
    from twinserve.entrypoints.cli.interleaved_calibration import InterleavedCalibration
    from twinserve.gpu.engine.llm_engine import LLMEngine
    from twinserve.gpu.engine.replay import replay_real, write_real_run
    from twinserve.gpu.measurement.profiler import speed_probe
    set_threads(args.threads)
    eargs, runner = load_runner(args, weights_from)
    log(f"real engine: {runner.device} {runner.dtype}, {runner.num_gpu_blocks} KV blocks; "
        f"{len(trace)} requests")
    cal = None
    if args.profile is None:
        cal = InterleavedCalibration(args, eargs, runner, log)
        cal.measure_grid()
    dirs = []
    for i in range(args.real_repeats):
        before = cal.measure_level() if cal is not None else speed_probe(runner)
        engine = LLMEngine(eargs, runner=runner, usage_context="server")  # fresh scheduler, cache
        replay = replay_real(engine, trace, progress=not args.quiet, detokenize=args.detokenize)
        label = f"real {args.scheduling_policy}" + (f" #{i + 1}" if args.real_repeats > 1 else "")
        dirs.append(write_real_run(replay, engine, out / ("real" if i == 0 else f"real-{i + 1}"),
                                   desc, model, label))
        write_speed_probe(dirs[-1] / SPEED_PROBE_FILE, before, speed_probe(runner))
        log(f"real replay {i + 1}/{args.real_repeats}: {replay.wall_time_s:.1f} s wall, "
            f"{len(replay.steps)} steps")
    if cal is None:
        return dirs, args.profile
    return dirs, cal.save(out / "profile.json", f"Calibrated by validate"
                          f"{' (quick)' if args.quick else ''} on the model load it replayed on.")


def run_validate(args: argparse.Namespace, weights_from: ModelRunner | None = None) -> int:
    """``twinserve validate``; ``weights_from``: replay on that runner's weights (the fidelity
    study's replays run on its calibration's load)."""
    from twinserve.reports import write_report
    from twinserve.reports.fidelity import (
        error_row,
        error_rows,
        format_errors,
        step_time_row,
        tenant_ttft_rows,
        write_errors,
    )
    from twinserve.reports.repeatability import (
        format_repeatability,
        repeatability,
        write_repeatability,
    )
    from twinserve.simulator.calibration import predicted_seconds
    from twinserve.simulator.twin_of_run import simulate_like
    from twinserve.traces import trace_desc
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.model = model = model_dir_or_default(args.model)
    trace = load_workload(args)
    desc = trace_desc(args)
    log = (lambda msg: None) if args.quiet else (
        lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.reuse_real:
        if args.profile is None:
            raise ValueError("--reuse-real needs --profile (no backend is loaded to calibrate).")
        real_dirs, profile = [Path(d) for d in args.reuse_real], args.profile
    else:
        real_dirs, profile = real_runs(args, trace, desc, out, model, log, weights_from)
    real_config = json.loads((real_dirs[0] / "config.json").read_text())
    summaries = [json.loads((d / "summary.json").read_text()) for d in real_dirs]
    tp = int(real_config.get("tensor_parallel_size", 1))
    runs = [read_recorded_samples([d]) for d in real_dirs]  # each replay's steps
    fit = profile_fit(profile, model, tp)
    speeds, own_speeds = host_speeds(real_dirs, fit), replay_speeds(runs, fit)
    which = "host" if args.at_host_speed else "replay" if args.at_replay_speed else None
    if which is not None:
        chosen = speeds if which == "host" else own_speeds
        profile = at_speed(profile, chosen, which, out / f"profile-at-{which}-speed.json")
        log(f"profile at the replays' {which} speed ({statistics.median(chosen):.3f}x the "
            f"calibration's time): {profile}")
    sim = simulate_like(real_config, model, profile, trace, out / "sim", desc, log)
    rows = error_rows(summaries, sim.summary)
    if speeds:  # the host's speed alone moves the step times by this much
        rows.append(error_row(HOST_SPEED_METRIC, speeds, 1.0))
    if own_speeds:  # ... and by this much, read from the replays' own steps
        rows.append(error_row(REPLAY_SPEED_METRIC, own_speeds, 1.0))
    samples = [s for steps in runs for s in steps]
    predicted = predicted_seconds(samples, model, profile, int(real_config["block_size"]), tp)
    rows.append(step_time_row(sum(s.seconds for s in samples), predicted,
                              len(real_dirs) if samples else 0))
    rows += tenant_ttft_rows(real_dirs, out / "sim")
    write_errors(out / "errors.csv", rows)
    print(format_errors(rows, f"sim vs real ({real_config['scheduling_policy']}, "
                              f"{len(trace)} requests, {len(real_dirs)} real run(s), "
                              f"profile {profile})"))
    repeats = repeatability(summaries, sim.summary)
    (out / "repeatability.csv").unlink(missing_ok=True)
    if repeats:
        write_repeatability(out / "repeatability.csv", repeats)
        print("  " + format_repeatability(repeats))
    try:
        report = write_report([*real_dirs, out / "sim"], out / "report.html",
                              title=f"twinserve validate: {real_config['scheduling_policy']}")
        print(f"report: {report}")
    except Exception as exc:  # noqa: BLE001 (the error table is the result, not the report)
        print(f"report not written: {exc}", file=sys.stderr)
    return 0
