"""A fleet replay's cost counted, not timed: instructions, cache misses and branch mispredictions.

The fleet benchmark (``fleet_routers``) times 4-replica replays against a lone replica at the
same load per replica, and on this shared host the ratio of a fleet behind a router that reads
the replicas moves between rounds far more than the lone replica's time does. This counts
instead, under valgrind's cachegrind (a simulated two-level cache and branch predictor): a
replay gives the same counts on any load, and from run to run (each child's ``PYTHONHASHSEED``
is 0). Each replay runs in a fresh interpreter twice, in full and stopped just before the
replay (the trace built, a 50-request warm-up done), both ending with ``os._exit`` (no
collection at exit); the difference, per request, is the replay's. The replays:

- ``lone``: 1 replica fed every request at a quarter of the rate (the same load per replica);
- ``round-robin``, ``least-outstanding``, ``cache-aware``: the fleets behind each router;
- the picks of ``--split`` (a router that reads the replicas) replayed without its own work,
  three ways: ``apart`` (the replicas one after the other, reading nothing), ``interleaved``
  (one environment, reading nothing: each replica runs up to its own next request) and ``read``
  (one environment, reading the replicas at every arrival as the router does, so a replica's
  decode run crosses every arrival: ``simulator.engine._lazy_run``).

From ``apart`` to ``interleaved``, to ``read``, to the fleet behind ``--split`` itself, each
step adds one thing: the replicas' interleaving, the reads at every arrival, the router's own
work.

The cache modelled defaults to this machine's first level (32 KiB, 8-way) and its per-core
second level (1 MiB, 8-way) as cachegrind's last level, where the replicas' interleaved states
show. Needs ``valgrind`` on the PATH (Debian: ``apt install valgrind``); about 40 times slower
than the replay itself, two replays at a time (``--jobs``).

    python -m twinserve.benchmarks.fleet_cachegrind [--num-requests 2000] [--num-apps 24]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from twinserve.benchmarks.fleet_pages import LONE, REPLICAS, lone_or_fleet
from twinserve.benchmarks.fleet_routers import HARDWARE, MODEL, _picks, _Replayed
from twinserve.simulator import simulate

FLEETS = ("round-robin", "least-outstanding", "cache-aware")
SPLITS = ("apart", "interleaved", "read")
# cachegrind's events, summed as printed: (column, its events)
COLUMNS = (("instructions", ("Ir",)), ("D1 misses", ("D1mr", "D1mw")),
           ("LL misses", ("DLmr", "DLmw", "ILmr")), ("branch mispredictions", ("Bcm", "Bim")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--num-apps", type=int, default=24)
    p.add_argument("--split", default="least-outstanding",
                   help="the router whose picks are replayed apart, interleaved and read")
    p.add_argument("--d1", default="32768,8,64", help="first-level data cache: size,assoc,line")
    p.add_argument("--ll", default="1048576,8,64", help="last level modelled: size,assoc,line")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--replay", help=argparse.SUPPRESS)  # a child: one replay
    p.add_argument("--stop-before", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.replay:
        replay(args.replay, args.num_requests, args.num_apps, args.stop_before)
        sys.stdout.flush()
        os._exit(0)  # (no collection at exit in either child: the difference is the replay's)
    for flag, value in (("--num-requests", args.num_requests), ("--num-apps", args.num_apps),
                        ("--jobs", args.jobs)):
        if value < 1:
            p.error(f"{flag} must be at least 1, got {value}")
    if args.split not in FLEETS or args.split == "round-robin":
        p.error(f"--split: a router that reads the replicas, one of {FLEETS[1:]}")
    if shutil.which("valgrind") is None:
        p.error("valgrind is not on the PATH (Debian: apt install valgrind)")
    names = [LONE, *FLEETS, *(f"{args.split}:{how}" for how in SPLITS)]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        runs = {(name, stop): pool.submit(_child, name, stop, args, Path(tmp))
                for name in names for stop in (False, True)}
        counts = {name: per_request(runs[name, False].result(), runs[name, True].result(),
                                    args.num_requests) for name in names}
    print(f"{args.num_requests} requests, {args.num_apps} applications; {REPLICAS} x {MODEL} on "
          f"{HARDWARE}; per request, cachegrind (D1 {args.d1}, LL {args.ll}, PYTHONHASHSEED=0); "
          f"each against 1 replica fed every request at a quarter of the rate\n")
    print("| replay | " + " | ".join(column for column, _ in COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    lone = counts[LONE]
    for name in names:
        cells = []
        for _, events in COLUMNS:
            value, base = (sum(counts[name][e] for e in events), sum(lone[e] for e in events))
            cells.append(f"{value:,.0f}" + ("" if name == LONE else f" ({value / base:.3f}x)"))
        print(f"| {name} | " + " | ".join(cells) + " |")


def replay(name: str, num_requests: int, num_apps: int, stop_before: bool = False) -> None:
    """The child's replay (``name``: ``lone``, a router, or ``router:how``), after its trace
    and warm-up; ``stop_before``: returns before it."""
    router, _, how = name.partition(":")
    cfg, trace = lone_or_fleet(router, num_requests, num_apps)
    kwargs: dict = {}
    warm: dict = {}
    if how:
        picks, flags = _picks(cfg, trace)
        reads = flags if how == "read" else (False, False, False)
        kwargs = {"router": _Replayed(picks, *reads), "replicas_apart": how == "apart"}
        # (a replayed router walks its picks once: the warm-up has its own)
        warm = {**kwargs, "router": _Replayed(picks, *reads)}
    simulate(cfg, trace[:50], **warm)
    if not stop_before:
        simulate(cfg, trace, **kwargs)


def _child(name: str, stop_before: bool, args: argparse.Namespace, tmp: Path) -> dict[str, int]:
    """One child under cachegrind: its event totals."""
    out = tmp / f"{name.replace(':', '-')}{'-stop' if stop_before else ''}.out"
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", "--branch-sim=yes",
           f"--I1={args.d1}", f"--D1={args.d1}", f"--LL={args.ll}",
           f"--cachegrind-out-file={out}", sys.executable, "-m",
           "twinserve.benchmarks.fleet_cachegrind", "--replay", name, "--split", args.split,
           "--num-requests", str(args.num_requests), "--num-apps", str(args.num_apps)]
    # one hash seed for every child: the same counts on every run (string hashes order sets)
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(cmd + (["--stop-before"] if stop_before else []), env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"replay {name!r} under cachegrind failed:\n{done.stderr[-2000:]}")
    return totals(out.read_text())


def totals(text: str) -> dict[str, int]:
    """A cachegrind output file's program totals, by event name."""
    events: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("summary:"):
            if events is None:
                break
            values = [int(v) for v in line.split()[1:]]
            if len(values) != len(events):
                raise ValueError("cachegrind output: a summary that does not match its events")
            return dict(zip(events, values))
    raise ValueError("cachegrind output without an events line and a summary")


def per_request(full: dict[str, int], stopped: dict[str, int], num_requests: int
                ) -> dict[str, float]:
    """The replay's own counts per request: the full child's less the one stopped before."""
    return {event: (full[event] - stopped.get(event, 0)) / num_requests for event in full}


if __name__ == "__main__":
    main()
