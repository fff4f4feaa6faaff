"""Routers in front of real replicas and the twin's, over seeds and interleaved rounds: mean
and p99 TTFT per router, real beside twin, per seed and pooled.

    python -m twinserve.benchmarks.dp_routers --seeds 0 1 --rounds 2 [--tail 5] [--twin-only] \\
        -- --data-parallel-size 2 --router round-robin,least-outstanding,cache-aware \\
        --trace multi-app ... --profile PROFILE.json

Everything after ``--`` is ``twinserve validate``'s flags (``--seed`` is set per seed). Each
seed's workload runs once through the twin per router and ``--rounds`` times through the real
replicas, the routers' order rotated each round, so a slow minute of a shared host falls on
every router alike. Pooled rows take every request of every seed and round: a p99 of 2 x 300
requests is the 7th worst of 600, where one run's is the 3rd worst of 300.

``--at-replay-speed`` runs each seed's twin, per router, on the profile scaled to that
router's real runs' own speed (their steps' measured time over the profile's, the median over
the rounds), as ``validate --at-replay-speed`` does: the host's drift between calibration and
the runs taken out, what is left is the twin's routing and scheduling. Each real run's speed
is printed with it either way.

``--tail K`` prints, for each real run, its K slowest requests with where they went and what
the router read at their arrival (each replica's running, waiting, prompt tokens queued and its
step's time left), and how many of the prompt's tokens each replica held by the router's index
(cache-aware only): the material for telling a routing mistake from a slow host.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from twinserve.core.engine_args import EngineArgs
from twinserve.core.kv_events import KVCacheEvent
from twinserve.core.metrics import RequestRecord
from twinserve.core.request import Request
from twinserve.routers import ReplicaLoad, Router, make_router
from twinserve.routers.hashing import prompt_block_hashes
from twinserve.traces import TraceRequest

if TYPE_CHECKING:
    from twinserve.simulator.hardware import FittedParams


@dataclass(slots=True)
class RoutingLog:
    """A router that records what its inner router chose and read (the same protocol and
    attributes, so a backend treats it as the inner one)."""

    inner: Router
    block_size: int
    rows: dict[str, tuple[int, list[tuple[int, int, int, float]], list[int]]] = \
        field(default_factory=dict)

    @property
    def uses_kv_events(self) -> bool:
        return bool(getattr(self.inner, "uses_kv_events", False))

    @property
    def reads_loads(self) -> bool:
        return bool(getattr(self.inner, "reads_loads", True))

    @property
    def reads_kv_usage(self) -> bool:
        return bool(getattr(self.inner, "reads_kv_usage", True))

    def route(self, request: Request, replicas: Sequence[ReplicaLoad]) -> int:
        held = self._held(request, len(replicas))  # before the route touches anything
        chosen = self.inner.route(request, replicas)
        seen = [(r.num_running, r.num_waiting, r.num_prefill_tokens, 1000 * r.step_left_s)
                for r in replicas]
        self.rows[request.request_id] = (chosen, seen, held)
        return chosen

    def _held(self, request: Request, n: int) -> list[int]:
        """Per replica, the prompt tokens from the first its index holds (-1 without one)."""
        holders = getattr(self.inner, "holders", None)
        if holders is None:
            return [-1] * n
        held, alive = [0] * n, set(range(n))
        for block_hash in prompt_block_hashes(request, self.block_size):
            alive &= set(holders(block_hash))
            if not alive:
                break
            for i in alive:
                held[i] += self.block_size
        return held

    def on_kv_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        self.inner.on_kv_events(replica, events)

    def on_replica_reset(self, replica: int) -> None:
        self.inner.on_replica_reset(replica)


@dataclass(slots=True, frozen=True)
class Run:
    seed: int
    round: int  # -1: the twin
    router: str
    records: list[RequestRecord]
    duration_s: float
    log: RoutingLog
    # a real run's steps' measured time over the profile's (nan: the profile has no fit); the
    # twin's: the scale its profile ran at (1.0: as given)
    speed: float = math.nan

    def ttfts_ms(self) -> np.ndarray:
        return np.array([1000 * r.ttft for r in self.records if r.success])


def figures(runs: Sequence[Run]) -> dict[str, float]:
    """Mean and p99 TTFT over every request of ``runs``, requests per second, hit rate."""
    ttft = np.concatenate([r.ttfts_ms() for r in runs])
    done = sum(len(r.records) for r in runs)
    prompt = sum(x.input_tokens for r in runs for x in r.records)
    cached = sum(x.cached_tokens for r in runs for x in r.records)
    return {"mean": float(ttft.mean()), "p99": float(np.percentile(ttft, 99)),
            "rps": done / sum(r.duration_s for r in runs), "hits": cached / max(prompt, 1)}


def format_rows(title: str, routers: Sequence[str], real: Sequence[Run],
                twin: Sequence[Run]) -> str:
    lines = [f"{title}", "| router | mean TTFT real / twin | p99 TTFT real / twin | req/s real "
             "| prefix hits real / twin |", "|---|---|---|---|---|"]
    for name in routers:
        mine = [r for r in real if r.router == name]
        t = figures([r for r in twin if r.router == name])
        if mine:
            f = figures(mine)
            lines.append(f"| {name} | {f['mean']:.1f} / {t['mean']:.1f} ms | {f['p99']:.1f} / "
                         f"{t['p99']:.1f} ms | {f['rps']:.2f} | {100 * f['hits']:.1f} / "
                         f"{100 * t['hits']:.1f}% |")
        else:
            lines.append(f"| {name} | - / {t['mean']:.1f} ms | - / {t['p99']:.1f} ms | - | - / "
                         f"{100 * t['hits']:.1f}% |")
    return "\n".join(lines)


def format_tail(run: Run, k: int) -> str:
    worst = sorted(run.records, key=lambda r: -r.ttft)[:k]
    where = "twin" if run.round < 0 else f"round {run.round}"
    lines = [f"seed {run.seed} {where} {run.router}: the {k} slowest (running, waiting, "
             "queued prompt tokens, step left ms per replica; prompt tokens held)"]
    for r in worst:
        chosen, seen, held = run.log.rows.get(r.request_id, (-1, [], []))
        loads = " ".join(f"[{a},{b},{c},{d:.0f}]" for a, b, c, d in seen)
        lines.append(f"  {r.request_id:>10} t={r.arrival_time:7.2f}s TTFT {1000 * r.ttft:6.1f} ms "
                     f"prompt {r.input_tokens} cached {r.cached_tokens} -> replica {chosen} "
                     f"{loads} held {held}")
    return "\n".join(lines)


def wins(runs: Sequence[Run], routers: Sequence[str], metric: str) -> str:
    """How often, over (seed, round) groups, each router had the lowest ``metric``."""
    groups: dict[tuple[int, int], dict[str, float]] = {}
    for run in runs:
        groups.setdefault((run.seed, run.round), {})[run.router] = figures([run])[metric]
    best = [min(g, key=g.__getitem__) for g in groups.values() if len(g) == len(routers)]
    return ", ".join(f"{name} {best.count(name)}/{len(best)}" for name in routers)


def _validate_args(flags: list[str], seed: int) -> argparse.Namespace:
    from twinserve.entrypoints.cli.main import build_parser, parse_args
    return parse_args(build_parser(only="validate"),
                      ["validate", *flags, "--seed", str(seed), "--out", "/dev/null"])


def run_seed(flags: list[str], seed: int, rounds: int, twin_only: bool,
             at_replay_speed: bool = False) -> tuple[list[Run], list[Run]]:
    from twinserve.core.model_config import ModelConfig
    from twinserve.entrypoints.cli.calibrate import engine_of, model_dir_or_default
    from twinserve.entrypoints.cli.validate_dp import profile_prices
    from twinserve.fidelity.speeds import profile_fit
    from twinserve.fidelity.workload import TraceSpec
    from twinserve.gpu.models.default_model import resolve_model_source
    args = _validate_args(flags, seed)
    if not args.profile:
        raise ValueError("--profile is required (a profile calibrated with one thread).")
    args.model = model_dir_or_default(args.model)
    trace = list(TraceSpec.from_namespace(args).load().requests)
    engine = engine_of(args)
    prices = profile_prices(engine, args.profile)
    routers = [r for r in engine.router.split(",") if r]
    real: list[Run] = []
    if not twin_only:
        vocab = ModelConfig.from_dir(resolve_model_source(engine.model)[0]).vocab_size
        fit = profile_fit(args.profile, str(engine.model))
        for k in range(rounds):
            for name in routers[k % len(routers):] + routers[:k % len(routers)]:
                real.append(_real_run(engine.replace(router=name), trace, vocab, prices, fit,
                                      seed, k))
    with tempfile.TemporaryDirectory() as scaled:
        twin = [_twin_run(engine, trace, name, prices, seed, args.profile,
                          [r.speed for r in real if r.router == name] if at_replay_speed
                          else None, scaled) for name in routers]
    return real, twin


def _real_run(engine: EngineArgs, trace: list[TraceRequest], vocab: int,
              prices: dict[str, float], fit: FittedParams | None, seed: int, k: int) -> Run:
    from twinserve.entrypoints.cli.validate_dp import replay_fleet_records
    from twinserve.simulator.calibration import run_speed
    log = RoutingLog(make_router(engine.router, engine.block_size, prices), engine.block_size)
    replay = replay_fleet_records(engine, trace, vocab, log)
    speed = run_speed(fit, replay.samples) if fit is not None else math.nan
    run = Run(seed, k, engine.router, replay.records, replay.duration_s, log, speed)
    print(f"seed {seed} round {k} {engine.router}: mean TTFT {figures([run])['mean']:.1f} ms, "
          f"steps at {speed:.3f}x the profile's time", flush=True)
    return run


def _twin_run(engine: EngineArgs, trace: list[TraceRequest], name: str,
              prices: dict[str, float], seed: int, profile: str, speeds: list[float] | None,
              scaled: str) -> Run:
    """The twin behind ``name`` on ``profile``, or, given the real runs' ``speeds``, on it
    scaled to their median (written under ``scaled``; the router keeps the real front's
    prices)."""
    from pathlib import Path

    from twinserve.entrypoints.cli.validate_dp import twin_config
    from twinserve.fidelity.speeds import at_speed
    from twinserve.simulator import simulate
    scale = 1.0
    if speeds is not None:
        speeds = [v for v in speeds if math.isfinite(v)]
        profile = str(at_speed(profile, speeds, "replay", Path(scaled) / f"{seed}-{name}.json"))
        scale = statistics.median(speeds)
    log = RoutingLog(make_router(name, engine.block_size, prices), engine.block_size)
    result = simulate(twin_config(engine, name, profile), trace, router=log)
    end = max(r.finish_time for r in result.records)
    return Run(seed, -1, name, list(result.records), end, log, scale)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rounds", type=int, default=1, help="real runs per seed and router")
    p.add_argument("--tail", type=int, default=0, metavar="K", help="print each run's K slowest")
    p.add_argument("--twin-only", action="store_true", help="the twin's side only (seconds)")
    p.add_argument("--at-replay-speed", action="store_true",
                   help="the twin on the profile scaled to the real runs' own speed")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then twinserve validate's flags")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}.")
    if args.at_replay_speed and args.twin_only:
        raise ValueError("--at-replay-speed scales the twin to the real runs: not with "
                         "--twin-only.")
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    real: list[Run] = []
    twin: list[Run] = []
    for seed in args.seeds:
        r, t = run_seed(flags, seed, args.rounds, args.twin_only, args.at_replay_speed)
        real += r
        twin += t
    routers = list(dict.fromkeys(run.router for run in twin))
    for seed in args.seeds:
        print(format_rows(f"\nseed {seed}", routers, [r for r in real if r.seed == seed],
                          [r for r in twin if r.seed == seed]))
    print(format_rows(f"\npooled: seeds {args.seeds}, {args.rounds} round(s)", routers, real, twin))
    for side, runs in (("real", real), ("twin", twin)):
        if runs:
            print(f"lowest mean TTFT ({side}, per seed and round): {wins(runs, routers, 'mean')}; "
                  f"lowest p99: {wins(runs, routers, 'p99')}")
    if real:
        spread = {name: [figures([r])["mean"] for r in real if r.router == name] for name in routers}
        print("real mean TTFT per run: " + "; ".join(
            f"{k} {statistics.fmean(v):.1f} (" + ", ".join(f"{x:.1f}" for x in v) + ")"
            for k, v in spread.items()))
        print("real steps' time over the profile's, per run: " + "; ".join(
            f"{name} " + ", ".join(f"{r.speed:.3f}" for r in real if r.router == name)
            for name in routers) + (" (the twin ran at each seed's median)"
                                    if args.at_replay_speed else ""))
    if args.tail:
        for run in real or twin:
            print(format_tail(run, args.tail))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
