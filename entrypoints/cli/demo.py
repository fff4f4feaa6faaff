"""``twinserve demo``: the main job on the embedded defaults, told as two stories.

1. Policies in simulation: a slice of the bundled Azure conv trace, with a heavy and a light
   tenant and two priority classes, through the default twin (Llama-3-8B on an A100-80GB, its
   step times fitted to measurements) under fcfs, priority and fair.
2. The twin against reality (``twinserve.fidelity.validate``): the twin of the bundled
   SmolLM2-135M model (CPU) is calibrated over the step space a short slice can reach (or
   reused from this machine's profile cache), the slice is replayed through the real engine
   (three times) and through that twin, which is judged against the median and spread of the
   replays; then again at the replays' own speed.
3. ``report.html``: an index linking ``policies.html`` and ``twin-vs-real.html``, one page per
   story (they share no table and no axis: one is an A100's simulation, the other a CPU's).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from twinserve.entrypoints.cli.validate import positive_int
from twinserve.fidelity import measurement_threads
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.simulator.run import DEFAULT_SIM_HARDWARE
from twinserve.traces import assign_priorities, assign_tenants, first_n, load_trace, scale_time

if TYPE_CHECKING:
    from twinserve.core.metrics import RequestRecord
    from twinserve.reports.stories import TwinRun

POLICIES = ("fcfs", "priority", "fair")
TENANTS = {"heavy": 0.8, "light": 0.2}
PRIORITIES = {0: 0.2, 1: 0.8}


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="the main job: simulate policies, run the real engine, report",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo",
                   help="folder for the runs and the pages: report.html (the index), "
                   "policies.html, twin-vs-real.html")
    p.add_argument("--num-requests", type=int, default=3000,
                   help="requests of the Azure conv trace to simulate (default 3000)")
    p.add_argument("--time-scale", type=float, default=1.3,
                   help="replay the simulated slice K times as fast (default 1.3: at the edge "
                   "of the A100's saturation, where the policies part the classes' TTFT)")
    p.add_argument("--real-requests", type=int, default=24,
                   help="requests replayed through the real engine (0 skips it)")
    p.add_argument("--real-repeats", type=positive_int, default=3,
                   help="real replays the twin is compared with (the median of each metric, "
                   "their spread beside it; default 3: one replay's tail moves with the host)")
    threads = measurement_threads()
    p.add_argument("--threads", type=positive_int, default=threads,
                   help="torch threads of the real engine (default: every core but one, "
                   f"here {threads}; calibrate.measurement_threads)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=run_demo)


def simulated_workload(num_requests: int, time_scale: float, seed: int):
    trace = scale_time(first_n(load_trace("azure-conv"), num_requests), time_scale)
    trace = assign_tenants(trace, TENANTS, seed=seed)
    return assign_priorities(trace, PRIORITIES, seed=seed)


def _mean_ttft_ms(records: list[RequestRecord], keep: Callable[[RequestRecord], bool]) -> float:
    """Mean TTFT (ms) of the successful requests ``keep`` selects (nan when none): the class
    each policy favours, where the means over all requests barely move."""
    ttfts = [r.ttft for r in records if r.success and keep(r)]
    return 1e3 * sum(ttfts) / len(ttfts) if ttfts else math.nan


def run_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    trace = simulated_workload(args.num_requests, args.time_scale, args.seed)
    desc = {"trace": "azure-conv", "num_requests": args.num_requests,
            "time_scale": args.time_scale, "tenants": TENANTS, "seed": args.seed}
    policy_dirs = []
    for policy in POLICIES:
        cfg = SimConfig(scheduling_policy=policy, label=f"sim {DEFAULT_SIM_HARDWARE} {policy}")
        result = simulate(cfg, trace, progress=True)
        policy_dirs.append(write_sim_run(result, out / f"sim-{policy}", desc))
        s, records = result.summary, result.records
        favoured = (_mean_ttft_ms(records, lambda r: r.priority == min(PRIORITIES)),
                    _mean_ttft_ms(records, lambda r: r.tenant == "light"))
        print(f"{cfg.label:<24} {s['request_throughput']:.2f} req/s, mean TTFT "
              f"{s['mean_ttft_ms']:.0f} ms (priority {min(PRIORITIES)}: {favoured[0]:.0f}, "
              f"light tenant: {favoured[1]:.0f}), p99 TTFT {s['p99_ttft_ms']:.0f} ms "
              f"({result.wall_time_s:.1f} s wall)")
    print(f"step times: {result.cost_model}")
    if result.roofline_gap:
        print(result.roofline_gap)
    from twinserve.reports.stories import write_story_pages
    reals: list[Path] = []
    twins: list[TwinRun] = []
    if args.real_requests > 0:
        reals, twins = _real_vs_sim(out, args.real_requests, args.seed, args.real_repeats,
                                    args.threads)
    pages = write_story_pages(out / "report.html", policy_dirs, reals, twins,
                              slos_ms={"ttft": 2000.0, "tpot": 100.0}, title="twinserve demo")
    for judged in pages.judged:
        print(judged.headline())
    told = [str(p) for p in (pages.policies, pages.twin) if p is not None]
    print(f"report: {pages.index} (the index of {' and '.join(told)})")
    return 0


def _real_vs_sim(out: Path, num_requests: int, seed: int, repeats: int,
                 threads: int) -> tuple[list[Path], list[TwinRun]]:
    """The real engine on the bundled model (CPU) and its twin on one short slice of the same
    trace, through the fidelity API as ``twinserve validate`` runs it: lengths clipped so a
    2-core CPU replays it in a minute or two, and slowed down (time scale 0.14) so the small
    engine on ``threads`` cores runs near saturation. The twin's profile is calibrated over the
    step space the slice can reach, on the very model load the replays run on (or reused from
    this machine's profile cache); then the same twin again at the replays' own speed."""
    from twinserve.core.engine_args import EngineArgs
    from twinserve.fidelity import CalibrationSettings, Progress, TraceSpec, ValidateSettings
    from twinserve.fidelity.profile_cache import default_folder
    from twinserve.fidelity.validation import validate
    from twinserve.reports.stories import TwinRun
    folder = out / "real-vs-sim"
    engine = EngineArgs(max_model_len=128, max_num_seqs=64, max_num_batched_tokens=256,
                        scheduling_policy="fcfs")
    workload = TraceSpec("azure-conv", num_requests=num_requests, max_output_tokens=32,
                         max_model_len=128, time_scale=0.14, tenants="heavy=4,light=1",
                         seed=seed).load()
    calibration = CalibrationSettings(threads=threads)
    progress = Progress("real engine and twin")
    try:
        first = validate(engine, workload, folder,
                         ValidateSettings(real_repeats=repeats, profile_cache=default_folder(),
                                          calibration=calibration), progress=progress)
    finally:
        progress.close()
    print(f"profile: {first.profile_source}")
    print(first.table.format())
    print("the same twin at the replays' own speed (one number taken from the replays; what "
          "remains is its scheduling, not the host's drift):")
    again = validate(engine, workload, folder / "at-replay-speed",
                     ValidateSettings(profile=str(first.profile), reuse_real=first.real_runs,
                                      at_speed="replay", calibration=calibration))
    print(again.table.format())
    return list(first.real_runs), [TwinRun(first.twin_run),
                                   TwinRun(again.twin_run, "at the replays' speed")]
