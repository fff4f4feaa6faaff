"""``twinserve demo``: the main job on the embedded defaults.

1. Simulates a slice of the bundled Azure conv trace on a Llama-3-8B / H100 twin under fcfs,
   priority and fair, with a heavy and a light tenant and two priority classes.
2. Calibrates the twin of the bundled SmolLM2-135M model (CPU) with ``twinserve calibrate``'s
   defaults, then replays a short slice through the real engine (three times) and through that
   twin, so the report shows simulation against reality (the median of the real replays);
   then prints the twin's errors again at the replays' own speed (``--at-replay-speed``).
3. Writes one HTML report comparing every run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from twinserve.entrypoints.cli.calibrate import measurement_threads
from twinserve.entrypoints.cli.validate import positive_int
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.traces import assign_priorities, assign_tenants, first_n, load_trace, scale_time

POLICIES = ("fcfs", "priority", "fair")
TENANTS = {"heavy": 0.8, "light": 0.2}
PRIORITIES = {0: 0.2, 1: 0.8}


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="the main job: simulate policies, run the real engine, report",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="folder for the runs and report.html")
    p.add_argument("--num-requests", type=int, default=3000,
                   help="requests of the Azure conv trace to simulate (default 3000)")
    p.add_argument("--time-scale", type=float, default=4.0,
                   help="replay the simulated slice K times as fast (default 4: just past the "
                   "H100's saturation, where the policies differ)")
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


def run_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    trace = simulated_workload(args.num_requests, args.time_scale, args.seed)
    desc = {"trace": "azure-conv", "num_requests": args.num_requests,
            "time_scale": args.time_scale, "tenants": TENANTS, "seed": args.seed}
    run_dirs = []
    for policy in POLICIES:
        cfg = SimConfig(scheduling_policy=policy, label=f"sim {policy} (llama-3-8b, h100)")
        result = simulate(cfg, trace, progress=True)
        run_dirs.append(write_sim_run(result, out / f"sim-{policy}", desc))
        s = result.summary
        print(f"sim {policy:<8} {s['request_throughput']:.2f} req/s, mean TTFT "
              f"{s['mean_ttft_ms']:.0f} ms, p99 TTFT {s['p99_ttft_ms']:.0f} ms, "
              f"Jain {s['jain_index']:.3f} ({result.wall_time_s:.1f} s wall)")
    if args.real_requests > 0:
        run_dirs += _real_vs_sim(out, args.real_requests, args.seed, args.real_repeats,
                                 args.threads)
    from twinserve.reports import write_report
    report = write_report(run_dirs, out / "report.html",
                          slos_ms={"ttft": 2000.0, "tpot": 100.0},
                          title="twinserve demo: policies in simulation, twin against reality")
    print(f"report: {report}")
    return 0


def _real_vs_sim(out: Path, num_requests: int, seed: int, repeats: int,
                 threads: int) -> list[Path]:
    """The real engine on the bundled model (CPU) and its twin on one short slice of the same
    trace: lengths clipped so a 2-core CPU replays it in a minute or two, and slowed down (time
    scale 0.14) so the small engine on one of those cores (``measurement_threads``) runs near
    saturation. The twin's profile comes from
    ``twinserve calibrate``'s defaults at the same engine limits (the whole step space, no
    trace), as a user would calibrate once for every workload: ``validate`` without a profile
    calibrates the very model load it then replays on (a fresh load of the same weights ran the
    same steps up to 19% apart here), and writes ``profile.json`` beside the runs."""
    from twinserve.entrypoints.cli.main import build_parser
    folder = out / "real-vs-sim"
    engine = ["--max-model-len", "128", "--max-num-seqs", "64",
              "--max-num-batched-tokens", "256"]
    argv = ["validate", "--trace", "azure-conv", "--num-requests", str(num_requests),
            "--max-output-tokens", "32", "--time-scale", "0.14", "--tenants", "heavy=4,light=1",
            "--seed", str(seed), "--policy", "fcfs", "--threads", str(threads), *engine]
    args = build_parser().parse_args([*argv, "--real-repeats", str(repeats),
                                      "--out", str(folder)])
    args.handler(args)
    reals = [folder / "real", *(folder / f"real-{i}" for i in range(2, repeats + 1))]
    print("the same twin at the replays' own speed (validate --at-replay-speed: one number "
          "taken from the replays; what remains is its scheduling, not the host's drift):")
    again = build_parser().parse_args([
        *argv, "--profile", str(folder / "profile.json"), "--reuse-real", *map(str, reals),
        "--at-replay-speed", "--quiet", "--out", str(folder / "at-replay-speed")])
    again.handler(again)
    return [*reals, folder / "sim"]
