"""The twin at fleet scale: routers on a multi-application workload, and a fleet's replay cost.

4 replicas of Llama-3-8B on H100s behind each router, fed the multi-application workload
(``traces.multi_app``: applications with their own 256-2,048-token system prompts, Zipf
popularity, Poisson arrivals at 40 req/s): mean and p99 TTFT, mean TPOT and prefix hit rate per
router, and each replay's CPU time per request against one replica fed a quarter of the requests
at a quarter of the rate (the same load per replica); then, in alternated rounds, the 4-replica
replays behind ``--cost-routers`` against that lone replica, against one fed every request at a
quarter of the rate (the same load per replica and the same run size: a replay's cost per request
grows with its size, all replicas together), against one fed round robin's share, and against
the fleet's own replicas replayed one at a time, each fed the requests its router sent it (the
same work, apart: what simulating them together adds); the median of the rounds' CPU times,
user + sys. Each fleet replay is followed at once by a replay of the lone replica fed every
request, and the median of those pairs' ratios is printed too: a pair shares the host's load of
the moment, which moves the rounds' medians on a shared machine.

The user turns and outputs are lognormal around ``--input-len`` and ``--output-len`` with the
Azure conversation trace's spread (``traces.multi_app``).

The default, 400 applications, is a workload whose system prompts (about 450k tokens) do not fit
in every replica's KV cache (about 445k tokens each, less the running batches): where to send an
application decides its hits. With ``--num-apps 24`` every replica holds every system prompt and
the routers differ only in how they spread the load.

    PYTHONPATH=... python -m twinserve.benchmarks.fleet_routers [--num-apps 24] [--calls]

``--decompose`` splits each fleet's cost over its replicas apart, replaying its router's recorded
picks: through the fleet's reads (everything but the router's own work), then through one
environment that reads nothing (the replicas' interleaving alone), then apart.

``--calls`` adds each replay's function calls per request against the lone replica's (cProfile):
a count that does not move with the host's load, where the CPU times do; and each fleet's
profiled time against the lone replica fed every request, split into the functions both call
as often, those only the fleet calls, and the rest: where its excess lies. ``--fresh-processes``
runs each replay of the rounds in a process of its own (spawned, timed around the replay only),
so that no replay inherits the heap, the allocator's arenas or the caches of the ones before it.
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing
import pstats
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from twinserve.core.kv_events import KVCacheEvent
from twinserve.core.request import Request
from twinserve.routers import (
    ROUTERS,
    ReplicaLoad,
    Router,
    reads_kv_usage,
    reads_loads,
    uses_kv_events,
)
from twinserve.simulator import SimConfig, SimResult, build_engine_config, simulate
from twinserve.simulator.run import fleet_router
from twinserve.traces import TraceRequest
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace

MODEL, HARDWARE = "llama-3-8b", "h100-sxm"
# the workload's defaults, besides its size (``fleet_pages`` replays the same)
WORKLOAD = {"request_rate": 40.0, "zipf_s": 0.8, "input_len": 256, "output_len": 384, "seed": 0}


def _row(name: str, summary: dict, wall: float, n: int, lone_per_request: float) -> str:
    return (f"| {name} | {summary['mean_ttft_ms']:.1f} ms | {summary['p99_ttft_ms']:.1f} ms | "
            f"{summary['mean_tpot_ms']:.1f} ms | {100 * summary['prefix_cache_hit_rate']:.1f}% | "
            f"{summary['request_throughput']:.2f} | {wall:.1f} s | {1e3 * wall / n:.2f} ms | "
            f"{wall / n / lone_per_request:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=8000)
    p.add_argument("--num-apps", type=int, default=400)
    p.add_argument("--zipf-s", type=float, default=WORKLOAD["zipf_s"])
    p.add_argument("--rate", type=float, default=WORKLOAD["request_rate"])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--input-len", type=int, default=WORKLOAD["input_len"],
                   help="the user turn, after the system prompt")
    p.add_argument("--output-len", type=int, default=WORKLOAD["output_len"])
    p.add_argument("--seed", type=int, default=WORKLOAD["seed"])
    p.add_argument("--repeats", type=int, default=3, help="runs of the cost comparison")
    p.add_argument("--cost-routers", default="round-robin,least-outstanding,cache-aware",
                   help="the routers of the cost comparison")
    p.add_argument("--calls", action="store_true",
                   help="also count the function calls per request of each (cProfile): "
                        "deterministic, where CPU times move with the host's load")
    p.add_argument("--fresh-processes", action="store_true",
                   help="run each replay of the rounds in a fresh process")
    p.add_argument("--decompose", action="store_true",
                   help="also replay each router's picks, with and without its reads, to split "
                        "its fleet's cost: the router, the reads, the replicas' interleaving")
    args = p.parse_args()
    workload = MultiAppConfig(num_requests=args.num_requests, request_rate=args.rate,
                              num_apps=args.num_apps, zipf_s=args.zipf_s, input_len=args.input_len,
                              output_len=args.output_len, seed=args.seed)
    trace = multi_app_trace(workload)
    print(f"{len(trace)} requests over {trace[-1].arrival_time:.0f} s, {workload.num_apps} "
          f"applications (Zipf s={workload.zipf_s}), {args.rate} req/s, {args.replicas} x {MODEL} "
          f"on {HARDWARE}\n")
    quarter = [replace(tr, arrival_time=tr.arrival_time * args.replicas)
               for tr in trace[:len(trace) // args.replicas]]
    lone_cfg = SimConfig(model=MODEL, hardware=HARDWARE)
    lone_wall, single = _cpu_time(lone_cfg, quarter)
    lone_per_request = lone_wall / len(quarter)
    print("| router | mean TTFT | p99 TTFT | mean TPOT | prefix hit rate | req/s | CPU | CPU/req | "
          "CPU/req vs 1 replica |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.routers.split(","):
        cfg = SimConfig(model=MODEL, hardware=HARDWARE, num_replicas=args.replicas, router=name)
        wall, result = _cpu_time(cfg, trace)
        print(_row(name, result.summary, wall, len(trace), lone_per_request), flush=True)
    print(_row(f"1 replica at {args.rate / args.replicas:g} req/s", single.summary, lone_wall,
               len(quarter), lone_per_request))
    share = trace[::args.replicas]  # what round robin hands replica 0: its very arrival stream
    # every request at a quarter of the rate: the same load per replica, the fleet's run size
    slowed = [replace(tr, arrival_time=tr.arrival_time * args.replicas) for tr in trace]
    cost_routers = args.cost_routers.split(",")
    fleet: dict[str, list[float]] = {name: [] for name in cost_routers}
    lone, whole, same = [], [], []  # alternated rounds, the median of each
    # each fleet replay's ratio to the lone replay fed every request that follows it at once:
    # the pair shares the host's state of the moment, where the rounds' medians drift apart
    paired: dict[str, list[float]] = {name: [] for name in cost_routers}
    picks = {name: _picks(SimConfig(model=MODEL, hardware=HARDWARE, num_replicas=args.replicas,
                                    router=name), trace) for name in cost_routers}
    shares = {name: [[tr for tr, at in zip(trace, picks[name][0]) if at == i]
                     for i in range(args.replicas)] for name in cost_routers}
    apart: dict[str, list[float]] = {name: [] for name in cost_routers}
    replayed: dict[str, list[float]] = {name: [] for name in cost_routers}
    shared: dict[str, list[float]] = {name: [] for name in cost_routers}
    cpu: Callable[..., float] = _fresh_cpu_time if args.fresh_processes else _replay_cpu_time
    for _ in range(args.repeats):
        for name in cost_routers:
            cfg = SimConfig(model=MODEL, hardware=HARDWARE, num_replicas=args.replicas, router=name)
            fleet[name].append(cpu(cfg, trace))
            whole.append(cpu(lone_cfg, slowed))
            paired[name].append(fleet[name][-1] / whole[-1])
            apart[name].append(sum(cpu(lone_cfg, share_of) for share_of in shares[name]))
            if args.decompose:
                order, flags = picks[name]
                replayed[name].append(cpu(cfg, trace, (order, *flags, True)))
                shared[name].append(cpu(cfg, trace, (order, False, False, False, False)))
        lone.append(cpu(lone_cfg, quarter))
        same.append(cpu(lone_cfg, share))
    median = statistics.median
    lone_ms, whole_ms = median(lone) / len(quarter), median(whole) / len(slowed)
    print(f"\nCPU time per request, median of {args.repeats} alternated rounds"
          f"{' (each replay in a fresh process)' if args.fresh_processes else ''}; 1 replica at a "
          f"quarter of the rate fed a quarter of the requests: {1e3 * lone_ms:.3f} ms, fed all "
          f"{len(slowed)}: {1e3 * whole_ms:.3f} ms")
    for name, walls in fleet.items():
        per_request = median(walls) / len(trace)
        print(f"- {args.replicas} replicas behind {name}: {1e3 * per_request:.3f} ms, "
              f"{per_request / lone_ms:.2f}x; {per_request / whole_ms:.2f}x at equal request "
              f"counts ({median(paired[name]):.2f}x paired: the median of each replay against "
              f"the lone one right after it); against 1 replica fed replica 0's round-robin share "
              f"{per_request / (median(same) / len(share)):.2f}x; against its replicas replayed "
              f"one at a time {per_request / (median(apart[name]) / len(trace)):.2f}x")
    if args.decompose:
        print("\nEach fleet's cost split, as ratios of the rounds' medians: the router's own work "
              "(the fleet against its picks replayed through its reads), the reads and lazy runs "
              "(those against the picks replayed in one environment that reads nothing), the "
              "replicas' interleaving (that against its replicas replayed one at a time), and "
              "the replicas apart against the lone replica fed all requests")
        for name in cost_routers:
            steps = [median(fleet[name]), median(replayed[name]), median(shared[name]),
                     median(apart[name]), whole_ms * len(trace)]
            print(f"- {name}: " + ", ".join(f"{label} {a / b:.3f}x" for label, a, b in zip(
                ("router", "reads", "interleaving", "apart vs lone"), steps, steps[1:])))
    if args.calls:
        lone_calls, whole_calls = _calls(lone_cfg, quarter), _calls(lone_cfg, slowed)
        print(f"\nFunction calls per request; 1 replica at a quarter of the rate fed a quarter "
              f"of the requests: {lone_calls.calls:.0f}, fed all: {whole_calls.calls:.0f}")
        fleets = {}
        for name in cost_routers:
            cfg = SimConfig(model=MODEL, hardware=HARDWARE, num_replicas=args.replicas, router=name)
            calls = fleets[name] = _calls(cfg, trace)
            print(f"- {args.replicas} replicas behind {name}: {calls.calls:.0f}, "
                  f"{calls.calls / lone_calls.calls:.3f}x; "
                  f"{calls.calls / whole_calls.calls:.3f}x at equal request counts")
        print("\nThe profile's time per request (us, cProfile's own per-call cost included), "
              "against 1 replica fed all requests: in the functions both call as often (within "
              "10%), in those only the fleet calls, and in the rest")
        for name, calls in fleets.items():
            same, only, rest = calls.split(whole_calls)
            print(f"- {name}: as often {same[1]:.0f} against {same[0]:.0f} ({same[1] / same[0]:.3f}x)"
                  f", the fleet's own {only:.0f}, the rest {rest[1]:.0f} against {rest[0]:.0f}")


class _Recording:
    """A router that notes, in ``picks``, where the one it wraps sends each request."""

    def __init__(self, inner: Router, picks: list[int]) -> None:
        self.inner, self.picks = inner, picks
        self.uses_kv_events, self.reads_kv_usage, self.reads_loads = (
            uses_kv_events(inner), reads_kv_usage(inner), reads_loads(inner))

    def route(self, request: Request, replicas: Sequence[ReplicaLoad]) -> int:
        index = self.inner.route(request, replicas)
        self.picks.append(index)
        return index

    def on_kv_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        self.inner.on_kv_events(replica, events)

    def on_replica_reset(self, replica: int) -> None:
        self.inner.on_replica_reset(replica)


class _Replayed:
    """A router that sends each request where ``picks`` says, doing no work of its own, and
    reads the replicas (loads, KV events, KV usage) as its flags say: the fleet's machinery
    without its router."""

    def __init__(self, picks: list[int], reads: bool, events: bool, usage: bool) -> None:
        self.picks, self.next = picks, 0
        self.reads_loads, self.uses_kv_events, self.reads_kv_usage = reads, events, usage

    def route(self, request: Request, replicas: Sequence[ReplicaLoad]) -> int:
        self.next += 1
        return self.picks[self.next - 1]

    def on_kv_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        pass

    def on_replica_reset(self, replica: int) -> None:
        pass


# (picks, reads loads, KV events, KV usage, replicas apart): a replay of recorded picks
Replay = tuple[list[int], bool, bool, bool, bool]


def _picks(cfg: SimConfig, trace: list[TraceRequest]) -> tuple[list[int], tuple[bool, bool, bool]]:
    """Where ``cfg``'s router (``simulate``'s own, ``fleet_router``) sends each request of
    ``trace``, and what it reads (loads, KV events, KV usage)."""
    build = build_engine_config(cfg)
    router = fleet_router(cfg, build.cost_model, build.engine_config.scheduler)
    picks: list[int] = []
    simulate(cfg, trace, router=_Recording(router, picks))
    return picks, (reads_loads(router), uses_kv_events(router), reads_kv_usage(router))


@dataclass(slots=True)
class _Profile:
    """A replay's cProfile, per request: its function calls (Python and built-in), and each
    function's calls and own time (seconds)."""

    calls: float
    functions: dict[tuple[str, int, str], tuple[float, float]]

    def split(self, lone: _Profile) -> tuple[tuple[float, float], float, tuple[float, float]]:
        """Own time per request (us), ``lone``'s against this one's: in the functions both call
        as often (within 10%), in those only this one calls, and in the rest."""
        same, only, rest = [0.0, 0.0], 0.0, [0.0, 0.0]
        for key in self.functions.keys() | lone.functions.keys():
            n_lone, t_lone = lone.functions.get(key, (0.0, 0.0))
            n, t = self.functions.get(key, (0.0, 0.0))
            if not n_lone:
                only += t
            elif n and 0.9 <= n / n_lone <= 1.1:
                same[0] += t_lone
                same[1] += t
            else:
                rest[0] += t_lone
                rest[1] += t
        return (1e6 * same[0], 1e6 * same[1]), 1e6 * only, (1e6 * rest[0], 1e6 * rest[1])


def _calls(cfg: SimConfig, trace: list[TraceRequest]) -> _Profile:
    """A replay's profile, per request."""
    profile = cProfile.Profile()
    profile.runcall(simulate, cfg, trace)
    stats = pstats.Stats(profile)
    n = len(trace)
    return _Profile(stats.total_calls / n,  # type: ignore[attr-defined]
                    {key: (row[1] / n, row[2] / n)
                     for key, row in stats.stats.items()})  # type: ignore[attr-defined]


def _cpu_time(cfg: SimConfig, trace: list[TraceRequest],
              replay: Replay | None = None) -> tuple[float, SimResult]:
    kwargs = {} if replay is None else {"router": _Replayed(*replay[:4]),
                                        "replicas_apart": replay[4]}
    t0 = time.process_time()
    result = simulate(cfg, trace, **kwargs)  # type: ignore[arg-type]
    return time.process_time() - t0, result


def _replay_cpu_time(cfg: SimConfig, trace: list[TraceRequest],
                     replay: Replay | None = None) -> float:
    return _cpu_time(cfg, trace, replay)[0]


def _warm_replay_cpu_time(cfg: SimConfig, trace: list[TraceRequest],
                          replay: Replay | None = None) -> float:
    """The replay's CPU time after a replay of its first 50 requests (lazy imports and loads)."""
    simulate(cfg, trace[:50], **({} if replay is None else {"router": _Replayed(*replay[:4])}))
    return _replay_cpu_time(cfg, trace, replay)


def _fresh_cpu_time(cfg: SimConfig, trace: list[TraceRequest],
                    replay: Replay | None = None) -> float:
    """``_warm_replay_cpu_time`` in a spawned process of its own."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_warm_replay_cpu_time, cfg, trace, replay).result()


if __name__ == "__main__":
    main()
