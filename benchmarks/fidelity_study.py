"""Fidelity of the twin on workloads its calibration never saw (issue 27).

    python -m twinserve.benchmarks.fidelity_study [--out runs/fidelity-study] [--rounds 3] \\
        [--workloads conv-600,code,...] [--profile PROFILE.json] [--model DIR] [--threads N] \\
        [--rate-scale 1]

1. One profile with ``twinserve calibrate``'s defaults (micro-benchmarks over the engine's whole
   space plus synthetic engine-loop workloads: no trace), at the study's engine limits, its
   level measured in rounds (the grid timed again before each round of replays, the engine
   loop's workloads split between its replays: ``InterleavedCalibration``, ``loop_schedule``);
   ``--profile`` uses a given one instead. No workload below is used to fit it.
2. Each workload replayed ``--rounds`` times on the real engine, in interleaved rounds (round r
   replays every workload once, in reverse order every other round: ``round_order``), so the
   machine's drift falls on all of them alike: ``OUT/real/<workload>-<r>``. Every replay runs
   on the calibration's weights (an engine of the workload's own limits and KV cache beside
   them: ``ModelRunner(weights_from=...)``), not on a load of its own.
3. Each workload simulated with the profile against its replays (``fidelity.validate`` with
   ``reuse_real``, as ``validate --reuse-real``):
   per metric the twin's error against the median of the replays, beside the replays' own spread
   (half their range over the median, in %). A metric passes when its error is within its target
   (throughput and mean E2EL 5%, mean TTFT, mean TPOT and p90 E2EL 10%) or within the spread
   where the spread is larger (marked ``~``). ``OUT/fidelity_study.csv`` holds every row.
4. Each workload simulated again with the profile scaled to the host's speed during its replays
   as their own steps tell it (``at_speed="replay"``, ``validate --at-replay-speed``: their
   measured step time over the profile's, the median over the replays; the row
   ``replay_speed_vs_profile``), the ``at replay`` columns: given that one number from the
   replays, the twin's error is its scheduling (batch sizes, queues, preemptions), not the
   host's drift since calibration. The row
   ``host_speed_vs_profile`` gives the speed probe's reading beside it.
5. The real engine against itself (``reports.repeatability``): each replay left out in turn and
   judged against the other replays' median and spread as the twin is, and the twin (in both
   columns) against the very same references. How often a repeat of the real run passes is the
   floor the host sets under any prediction; the last line of the table sets the twin beside it.

The workloads (``WORKLOADS``) are small (tens of requests, outputs of at most 32 tokens,
time-scaled near the saturation of the bundled SmolLM2-135M on one thread of a 2-core EPYC) so
that the whole study, calibration included, runs in about 35 minutes with three rounds there.
The engine runs on every core but one (``--threads``, ``fidelity.measurement_threads``): on a
shared 2-core VM two OpenMP threads spin-wait for each other whenever the hypervisor sets one
aside, and the same workload's replays scattered two to four times as wide (5.4-9.1% RMS in
eight five-round runs against 2.0-4.2% in three on one thread).
Run it on a quiet host all the same: with other processes on the cores a step can take 10-100x
its quiet time.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

from twinserve.core.engine_args import EngineArgs
from twinserve.fidelity.settings import CalibrationSettings
from twinserve.fidelity.study import StudySettings, StudyWorkload, round_order, run_study
from twinserve.fidelity.study_table import TABLE_METRICS, format_table, study_rows
from twinserve.fidelity.threads import measurement_threads
from twinserve.fidelity.workload import TraceSpec

__all__ = ["CALIBRATION_MODEL_LEN", "ENGINE", "TABLE_METRICS", "WORKLOADS", "format_table",
           "main", "round_order", "scaled", "study_rows"]

# The study's engine (every workload and the calibration): batch limits shared; the calibration
# runs at the longest model length (512, for Azure code and Mooncake prompts clipped to it),
# which covers the conv workloads' 128 too.
ENGINE = EngineArgs(max_num_seqs=32, max_num_batched_tokens=512, enable_prefix_caching=True,
                    enable_chunked_prefill=True)
CALIBRATION_MODEL_LEN = 512


def _conv(window: str, n: int, scale: float, **fields: str) -> TraceSpec:
    """Azure conv requests from ``window`` at 128 tokens (32 out), ``scale`` times the rate."""
    return TraceSpec("azure-conv", num_requests=n, time_window=window, time_scale=scale,
                     max_output_tokens=32, max_model_len=128, **fields)


def _long(trace: str, n: int, scale: float) -> TraceSpec:
    """A long-prompt trace clipped to 512 tokens (24 out)."""
    return TraceSpec(trace, num_requests=n, time_scale=scale, max_output_tokens=24,
                     max_model_len=512)


# KV blocks of the overloads: 6 requests of 128 tokens (block size 16), so a burst preempts
_OVERLOAD = {"scheduling_policy": "fcfs", "num_gpu_blocks_override": 48}
_FCFS = {"scheduling_policy": "fcfs"}
WORKLOADS: tuple[StudyWorkload, ...] = (
    StudyWorkload("conv-600", "Azure conv from 600 s, fcfs", _conv("600:", 32, 0.245), _FCFS),
    StudyWorkload("conv-2400", "Azure conv from 2400 s, fcfs", _conv("2400:", 32, 0.245), _FCFS),
    StudyWorkload("code", "Azure code (long prompts, clipped to 512), fcfs",
                  _long("azure-code", 20, 0.21), _FCFS),
    StudyWorkload("mooncake", "Mooncake conversation (prefix hits, clipped to 512), fcfs",
                  _long("mooncake", 20, 0.175), _FCFS),
    StudyWorkload("sys-prompt", "synthetic, 192-token system prompt shared by 90%, fcfs",
                  TraceSpec("synthetic", num_requests=32, request_rate=1.75, input_len=64,
                            output_len=24, range_ratio=0.5, prefix_len=192, prefix_share=0.9,
                            max_model_len=512), _FCFS),
    StudyWorkload("recompute", "overload burst, 48 KV blocks, preemption by recompute",
                  _conv("1200:", 24, 2.8), {**_OVERLOAD, "preemption_mode": "recompute"}),
    StudyWorkload("swap", "overload burst, 48 KV blocks, preemption by swap",
                  _conv("1200:", 24, 2.8),
                  {**_OVERLOAD, "preemption_mode": "swap", "swap_space": 0.5}),
    StudyWorkload("fair", "Azure conv from 3000 s, tenants heavy=3 light=1, fair",
                  _conv("3000:", 32, 0.245, tenants="heavy=3,light=1"),
                  {"scheduling_policy": "fair"}),
    StudyWorkload("priority", "Azure conv from 1800 s, priorities 0 (1/4) and 1, priority",
                  _conv("1800:", 32, 0.245, priorities="0=1,1=3"),
                  {"scheduling_policy": "priority"}),
)
_BY_NAME = {w.name: w for w in WORKLOADS}


def scaled(workload: StudyWorkload, num_requests: int | None,
           rate_scale: float) -> StudyWorkload:
    """``workload`` with ``num_requests`` requests (``None``: its own) and its arrival rate (time
    scale or request rate) multiplied by ``rate_scale``."""
    trace = workload.trace
    if num_requests is not None:
        trace = trace.replace(num_requests=num_requests)
    if rate_scale != 1.0:
        if trace.time_scale is not None:
            trace = trace.replace(time_scale=trace.time_scale * rate_scale)
        else:
            trace = trace.replace(request_rate=(trace.request_rate or math.inf) * rate_scale)
    return dataclasses.replace(workload, trace=trace)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", default="runs/fidelity-study")
    p.add_argument("--model", default=None, help="HF model directory (default: bundled SmolLM2)")
    p.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS),
                   help=f"comma-separated subset of: {', '.join(_BY_NAME)}")
    p.add_argument("--rounds", type=int, default=3, help="real replays per workload (median)")
    p.add_argument("--profile", default=None, help="use this profile instead of calibrating")
    p.add_argument("--num-requests", type=int, default=None,
                   help="override every workload's request count (quick runs)")
    p.add_argument("--dtype", default="auto")
    threads = measurement_threads()
    p.add_argument("--threads", type=_positive_int, default=threads,
                   help="torch threads (default: every core but one, here "
                   f"{threads}; fidelity.measurement_threads)")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply every workload's arrival rate (its time scale or request rate) "
                   "by this: the workloads sit near saturation of SmolLM2 on one thread of a "
                   "2-core EPYC, so another engine keeps their load at about its speed ratio "
                   "(1.43 for two threads there, as the studies before 2026-12-05 09:00 UTC ran)")
    p.add_argument("--resume", action="store_true", help="keep replays and profile found in OUT")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in _BY_NAME]
    if unknown or not names:
        p.error(f"--workloads: unknown {', '.join(unknown) or '(none given)'}; "
                f"known: {', '.join(_BY_NAME)}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if not (math.isfinite(args.rate_scale) and args.rate_scale > 0):
        p.error("--rate-scale must be a positive number")
    t_start, load_at_start = time.perf_counter(), _load_average()
    engine = ENGINE.replace(model=args.model, dtype=args.dtype)
    settings = StudySettings(args.rounds, args.profile, CALIBRATION_MODEL_LEN, args.resume,
                             CalibrationSettings(threads=args.threads))
    workloads = [scaled(_BY_NAME[n], args.num_requests, args.rate_scale) for n in names]
    rows = run_study(engine, workloads, args.out, settings,
                     lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(rows))
    profile = args.profile or str(Path(args.out) / "profile.json")
    print(f"table: {Path(args.out) / 'fidelity_study.csv'} "
          f"({time.perf_counter() - t_start:.0f} s, profile {profile}); load average "
          f"{load_at_start} at the start, {_load_average()} at the end")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _load_average() -> str:
    """The host's 1/5/15-minute load averages (a shared host's replays scatter with them)."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
