"""Where a fleet replay's extra CPU goes: the heap's pages, under three memory allocators.

The fleet benchmark (``fleet_routers``) finds a 4-replica replay behind a router that reads the
replicas costing more per request than a lone replica at the same load, and the excess spread
over the same functions, each called as often, each slower: the replicas' states interleave in
one process. This replays the lone replica (every request at a quarter of the rate) and the
fleets behind ``--routers``, each in a fresh interpreter, under each of ``--settings``:

- ``default``: CPython's own object allocator (pymalloc), the heap on 4 KiB pages;
- ``malloc``: ``PYTHONMALLOC=malloc``, glibc's allocator, still 4 KiB pages;
- ``malloc-thp``: glibc's allocator asked for transparent huge pages (2 MiB,
  ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``; the kernel must allow ``madvise`` mode).

``malloc`` against ``malloc-thp`` differs only in the pages, so the fleet's ratio moving between
the two is what its page-table misses cost. Each setting is the child process's environment,
named here and printed; this process's own is left as it is. Rounds alternate settings and
replays; the medians of the rounds' CPU times (user + sys, around the replay alone, after a
50-request warm-up) are printed, with each child's ``AnonHugePages`` at its end.

    python -m twinserve.benchmarks.fleet_pages [--num-apps 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

from twinserve.benchmarks.fleet_routers import HARDWARE, MODEL, WORKLOAD
from twinserve.simulator import SimConfig, simulate
from twinserve.traces import TraceRequest
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace

REPLICAS = 4  # (the fleet benchmark's model, hardware, replicas and workload)
LONE = "lone"
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "malloc": {"PYTHONMALLOC": "malloc"},
    "malloc-thp": {"PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
}
_CLEARED = ("PYTHONMALLOC", "GLIBC_TUNABLES", "PYTHONMALLOCSTATS", "MALLOC_ARENA_MAX")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=8000)
    p.add_argument("--num-apps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--routers", default="least-outstanding,cache-aware")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--replay", help=argparse.SUPPRESS)  # a child: one replay, its figures printed
    args = p.parse_args()
    if args.replay:
        _replay(args.replay, args.num_requests, args.num_apps)
        return
    settings = args.settings.split(",")
    unknown = [name for name in settings if name not in SETTINGS]
    if unknown:
        p.error(f"--settings: unknown {', '.join(unknown)} (known: {', '.join(SETTINGS)})")
    replays = [LONE, *args.routers.split(",")]
    cpu: dict[tuple[str, str], list[float]] = {(s, r): [] for s in settings for r in replays}
    huge: dict[str, int] = {}
    for _ in range(args.rounds):
        for setting in settings:
            for name in replays:
                seconds, huge_kb = _child(setting, name, args.num_requests, args.num_apps)
                cpu[setting, name].append(seconds)
                huge[setting] = max(huge.get(setting, 0), huge_kb)
    print(f"{args.num_requests} requests, {args.num_apps} applications; {REPLICAS} x {MODEL} on "
          f"{HARDWARE} against 1 replica fed every request at a quarter of the rate; CPU time "
          f"per request, median of {args.rounds} alternated rounds, each replay in a fresh "
          f"interpreter\n")
    print("| allocator | " + " | ".join(replays) + " | largest AnonHugePages |")
    print("|---|" + "---|" * (len(replays) + 1))
    for setting in settings:
        lone = statistics.median(cpu[setting, LONE]) / args.num_requests
        cells = [f"{1e6 * lone:.0f} us"]
        for name in replays[1:]:
            per_request = statistics.median(cpu[setting, name]) / args.num_requests
            cells.append(f"{1e6 * per_request:.0f} us, {per_request / lone:.2f}x")
        print(f"| {setting} | " + " | ".join(cells) + f" | {huge[setting]} kB |")


def _child(setting: str, name: str, num_requests: int, num_apps: int) -> tuple[float, int]:
    """One replay in a fresh interpreter with ``setting``'s environment: its CPU seconds and
    its ``AnonHugePages`` (kB) at the end."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(SETTINGS[setting])
    done = subprocess.run(
        [sys.executable, "-m", "twinserve.benchmarks.fleet_pages", "--replay", name,
         "--num-requests", str(num_requests), "--num-apps", str(num_apps)],
        env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"replay {name!r} under {setting!r} failed:\n{done.stderr}")
    fields = dict(part.split("=") for part in done.stdout.split())
    return float(fields["cpu_s"]), int(fields["anon_huge_kb"])


def lone_or_fleet(name: str, num_requests: int, num_apps: int
                  ) -> tuple[SimConfig, list[TraceRequest]]:
    """The fleet benchmark's workload and the replay ``name`` names: the lone replica fed every
    request at a quarter of the rate, or the fleet behind router ``name``."""
    trace = multi_app_trace(MultiAppConfig(num_requests=num_requests, num_apps=num_apps,
                                           **WORKLOAD))  # type: ignore[arg-type]
    if name == LONE:
        return (SimConfig(model=MODEL, hardware=HARDWARE),
                [replace(tr, arrival_time=tr.arrival_time * REPLICAS) for tr in trace])
    return SimConfig(model=MODEL, hardware=HARDWARE, num_replicas=REPLICAS, router=name), trace


def _replay(name: str, num_requests: int, num_apps: int) -> None:
    """The child's replay: the lone replica or a fleet behind router ``name``."""
    cfg, trace = lone_or_fleet(name, num_requests, num_apps)
    simulate(cfg, trace[:50])
    t0 = time.process_time()
    simulate(cfg, trace)
    seconds = time.process_time() - t0
    print(f"cpu_s={seconds!r} anon_huge_kb={_anon_huge_kb()}")


def _anon_huge_kb() -> int:
    """This process's anonymous memory on transparent huge pages (0 where Linux does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    main()
