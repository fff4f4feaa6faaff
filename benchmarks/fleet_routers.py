"""The twin at fleet scale: routers on a multi-application workload, and a fleet's replay cost.

4 replicas of Llama-3-8B on H100s behind each router, fed the multi-application workload
(``traces.multi_app``: 24 applications with their own 256-2,048-token system prompts, Zipf
popularity, Poisson arrivals at 40 req/s): mean and p99 TTFT, mean TPOT and prefix hit rate per
router; then the wall time of the 4-replica round-robin replay against one replica fed the same
requests at a quarter of the rate (the same load per replica), per request.

    PYTHONPATH=... python -m twinserve.benchmarks.fleet_routers --num-requests 4000
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from twinserve.routers import ROUTERS
from twinserve.simulator import SimConfig, simulate
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace

MODEL, HARDWARE = "llama-3-8b", "h100-sxm"


def _row(name: str, summary: dict, wall: float, n: int) -> str:
    return (f"| {name} | {summary['mean_ttft_ms']:.0f} ms | {summary['p99_ttft_ms']:.0f} ms | "
            f"{summary['mean_tpot_ms']:.1f} ms | {100 * summary['prefix_cache_hit_rate']:.1f}% | "
            f"{summary['request_throughput']:.2f} | {wall:.1f} s | {1e3 * wall / n:.2f} ms |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=4000)
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--input-len", type=int, default=1024, help="the user turn, after the system prompt")
    p.add_argument("--output-len", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    workload = MultiAppConfig(num_requests=args.num_requests, request_rate=args.rate,
                              input_len=args.input_len, output_len=args.output_len, seed=args.seed)
    trace = multi_app_trace(workload)
    print(f"{len(trace)} requests, {workload.num_apps} applications, {args.rate} req/s, "
          f"{args.replicas} x {MODEL} on {HARDWARE}\n")
    print("| router | mean TTFT | p99 TTFT | mean TPOT | prefix hit rate | req/s | wall | wall/req |")
    print("|---|---|---|---|---|---|---|---|")
    walls = {}
    for name in args.routers.split(","):
        cfg = SimConfig(model=MODEL, hardware=HARDWARE, num_replicas=args.replicas, router=name)
        t0 = time.process_time()
        result = simulate(cfg, trace)
        walls[name] = time.process_time() - t0
        print(_row(name, result.summary, walls[name], len(trace)), flush=True)
    quarter = [replace(tr, arrival_time=tr.arrival_time * args.replicas)
               for tr in trace[:len(trace) // args.replicas]]
    t0 = time.process_time()
    lone = simulate(SimConfig(model=MODEL, hardware=HARDWARE), quarter)
    wall = time.process_time() - t0
    print(_row(f"1 replica at {args.rate / args.replicas:g} req/s", lone.summary, wall, len(quarter)))
    fleet = walls.get("round-robin")
    if fleet is not None:
        print(f"\nCPU time per request, {args.replicas} replicas (round-robin) / 1 replica: "
              f"{(fleet / len(trace)) / (wall / len(quarter)):.2f}x")


if __name__ == "__main__":
    main()
