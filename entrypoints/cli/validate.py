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

Replicas (``--data-parallel-size N``) and disaggregated prefill/decode (``--prefill-instances X
--decode-instances Y [--kv-link L]``) run their own comparisons, with ``--profile``:
``validate_dp.py`` and ``validate_pd.py``.

Without ``--profile`` the backend is calibrated on the same model load over the part of the step
space the workload can reach within the engine's limits (batches up to the requests, steps up to
all its prompts at once, contexts up to its longest prompt + output; ``--calibrate-full-space``
for ``twinserve calibrate``'s whole grid, ``--quick`` for a smaller one; its engine-loop
workloads, which set the profile's level, before each replay, so that level is the host's during
the replays' minutes) and the profile saved as ``OUT/profile.json``, the samples it was fitted on
as ``OUT/profile_samples.csv`` (``calibrate --from-run ... --backend-samples`` refits them). The
profile is also kept in ``--profile-cache`` (default ``~/.cache/twinserve/profiles``), and a
later validate of the same machine (CPU, threads), model, dtype, engine limits and kernel
settings whose workload it covers reuses it instead of calibrating (the output says which);
``--no-profile-cache`` always calibrates. docs/fidelity-api.md says what the shortcut gives up.
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
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from twinserve.entrypoints.cli.calibrate import (
    add_calibration_flags,
    calibration_settings,
    engine_of,
    model_dir_or_default,
)
from twinserve.fidelity.speeds import HOST_SPEED_METRIC, REPLAY_SPEED_METRIC
from twinserve.fidelity.workload import TraceSpec, Workload

if TYPE_CHECKING:
    from twinserve.fidelity.validation import ValidateSettings
    from twinserve.gpu.worker.model_runner import ModelRunner
    from twinserve.traces import TraceRequest

# (names other commands import from here)
__all__ = ["HOST_SPEED_METRIC", "REPLAY_SPEED_METRIC", "add_parser", "load_workload",
           "positive_int", "run_validate", "validate_settings"]


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
                   help="calibrated hardware profile (default: a cached one that covers the "
                        "workload, else calibrate over the workload's reach)")
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
    p.add_argument("--quiet", action="store_true",
                   help="no messages (the progress bar and the error table remain)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--profile-cache", default=None, metavar="DIR",
                       help="folder of cached profiles (default: ~/.cache/twinserve/profiles)")
    cache.add_argument("--no-profile-cache", dest="use_profile_cache", action="store_false",
                       help="neither reuse nor keep a cached profile: always calibrate")
    p.add_argument("--calibrate-full-space", dest="full_space", action="store_true",
                   help="without --profile: calibrate over the engine's whole step space (as "
                        "twinserve calibrate does), not only the part the workload reaches")
    p.add_argument("--prefill-instances", type=positive_int, default=None, metavar="X",
                   help="disaggregated prefill/decode (with --decode-instances and --profile): "
                        "the real X + Y instances beside the twin's (docs/disaggregation.md)")
    p.add_argument("--decode-instances", type=positive_int, default=None, metavar="Y",
                   help="disaggregated prefill/decode: Y decode instances")
    p.add_argument("--kv-link", default=None,
                   help="with --prefill-instances: the twin's link (nvlink, infiniband, pcie or "
                        "measured; default: the profile's measured kv_link, else this "
                        "machine's connector measured now)")
    p.add_argument("--acceptance-profile", default=None, nargs="+", metavar="FILE",
                   help="with --speculative-config: the drafts' acceptance the twin replays, "
                        "measured on other workloads (replays' acceptance.json, merged where "
                        "several); default: the replay's own")
    add_engine_args(p)
    add_calibration_flags(p)
    p.set_defaults(handler=run_validate)


def load_workload(args: argparse.Namespace) -> list[TraceRequest]:
    """The requests the workload flags select (ValueError naming the flag)."""
    return list(TraceSpec.from_namespace(args).load().requests)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def validate_settings(args: argparse.Namespace) -> ValidateSettings:
    """The flags as ``fidelity.ValidateSettings``."""
    from twinserve.fidelity.profile_cache import default_folder
    from twinserve.fidelity.validation import ValidateSettings
    at_speed = "host" if args.at_host_speed else "replay" if args.at_replay_speed else None
    cache = None
    if getattr(args, "use_profile_cache", True):
        cache = Path(args.profile_cache) if args.profile_cache else default_folder()
    return ValidateSettings(args.profile, tuple(Path(d) for d in args.reuse_real or ()),
                            args.real_repeats, at_speed, args.detokenize, cache,
                            getattr(args, "full_space", False), calibration_settings(args),
                            tuple(Path(f) for f in getattr(args, "acceptance_profile", None) or ()))


def run_validate(args: argparse.Namespace, weights_from: ModelRunner | None = None) -> int:
    """``twinserve validate``: the flags as the fidelity API's settings, then
    ``fidelity.validate``; prints the error table. ``weights_from``: replay on that runner's
    weights (the fidelity study's replays run on its calibration's load)."""
    from twinserve.fidelity.progress import Progress
    from twinserve.fidelity.validation import validate
    from twinserve.reports import write_report
    args.model = model_dir_or_default(args.model)
    workload: Workload = TraceSpec.from_namespace(args).load()
    engine = engine_of(args)
    from twinserve.entrypoints.pd_front import PDDeployment
    pd = PDDeployment.of(getattr(args, "prefill_instances", None),
                         getattr(args, "decode_instances", None))
    if pd is not None:  # prefill and decode instances: entrypoints/cli/validate_pd.py
        from twinserve.entrypoints.cli.validate_pd import run_validate_pd
        return run_validate_pd(args, engine, workload, pd)
    if getattr(args, "kv_link", None) is not None:
        raise ValueError("--kv-link needs --prefill-instances and --decode-instances.")
    if engine.data_parallel_size > 1:  # replicas behind a router: entrypoints/cli/validate_dp.py
        from twinserve.entrypoints.cli.validate_dp import run_validate_dp
        return run_validate_dp(args, engine, list(workload.requests), dict(workload.desc))
    settings = validate_settings(args)
    progress = Progress("validate", messages=not args.quiet, bar=not settings.reuse_real)
    try:
        result = validate(engine, workload, args.out, settings,
                          weights_from=weights_from, progress=progress)
    finally:
        progress.close()
    print(f"profile: {result.profile_source}")
    if result.kernel_mismatch is not None:  # loud even under --quiet: the comparison is suspect
        print(f"WARNING: {result.kernel_mismatch}", file=sys.stderr)
    print(result.table.format())
    try:
        report = write_report([*result.real_runs, result.twin_run],
                              Path(args.out) / "report.html",
                              title=f"twinserve validate: {result.policy}")
        print(f"report: {report}")
    except Exception as exc:  # noqa: BLE001 (the error table is the result, not the report)
        print(f"report not written: {exc}", file=sys.stderr)
    return 0
