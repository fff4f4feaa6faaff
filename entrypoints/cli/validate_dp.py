"""``twinserve validate --data-parallel-size N --router NAME --profile P``: one workload through
N real replicas behind the router and through the twin's N replicas behind the same router.

Real: the data-parallel front (``entrypoints/dp_front.py``) in real time; each trace request is
submitted when its arrival time comes (greedy, ``max_tokens`` = its output length,
``ignore_eos``), routed by the router, and its replica's ``RequestRecord`` measured from the
arrival the front stamps as it submits it (``DataParallelFront.submit``): its TTFT counts the
wait for the replica's step in progress, as vLLM's API server counts it (with Ray actors, which
may run on other hosts' clocks, from when the replica read it).
Twin: ``simulator.simulate`` with ``num_replicas`` = N, the same router name and engine
settings, the profile (``--profile``; calibrated with one thread per replica) as hardware.

Per router, under ``OUT/<router>/``: the real run folders (``real``, ``real-2``... with
``--real-repeats``, each on a fresh fleet), the twin's (``sim``), both naming each request's
and each step's replica (a real step timed as a whole, as a single engine's replay times it),
and ``errors.csv`` (``reports.fidelity``'s rows: the twin against the median of the real runs,
the real runs' speed against the profile's, ``replay_speed_vs_profile``, and their steps' time
against the profile's prediction). ``--at-replay-speed`` runs the twin on the profile scaled to
that speed (``OUT/<router>/profile-at-replay-speed.json``; the router keeps the real front's
prices): what is left of its error is its routing and scheduling. ``OUT/report.html`` sets them
all side by side. Printed: mean and p99 TTFT, mean TPOT and prefix hit rate, real (median)
beside twin, the requests each replica served and the real steps' speed against the profile's.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinserve.core.engine_args import EngineArgs
from twinserve.core.metrics import RequestRecord, StepRecord, summarize
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.step_sample import StepSample
from twinserve.entrypoints.cli.validate_refusals import refuse_fleet_flags
from twinserve.gpu.engine.dp_client import replica_world
from twinserve.traces import TraceRequest

if TYPE_CHECKING:
    from twinserve.routers import Router
    from twinserve.simulator import SimConfig

METRICS = (("mean TTFT", "mean_ttft_ms", "ms"), ("p99 TTFT", "p99_ttft_ms", "ms"),
           ("mean TPOT", "mean_tpot_ms", "ms"), ("prefix hit rate", "prefix_cache_hit_rate", "%"))
FINISH_TIMEOUT_S = 600.0


@dataclass(slots=True, frozen=True)
class FleetRow:
    """One router's real (the median of its runs, per metric) and twin summaries, the
    requests each replica served (real: the first run's) and the real steps' measured time
    over the profile's (the median over the runs; nan where the profile has no fit)."""

    router: str
    real: dict[str, Any]
    twin: dict[str, Any]
    real_served: tuple[int, ...] = ()
    twin_served: tuple[int, ...] = ()
    replay_speed: float = float("nan")


@dataclass(slots=True, frozen=True)
class FleetReplay:
    """One real replay: the replicas' records by arrival and their steps by start (each naming
    its replica), the seconds from the first submission to the last end, replica 0's resolved
    configuration, and the steps' measured samples (``step_features.csv``)."""

    records: list[RequestRecord]
    duration_s: float
    config: dict[str, Any]
    steps: list[StepRecord] = field(default_factory=list)
    samples: list[StepSample] = field(default_factory=list)  # each step's, as ``steps``


class _Done:
    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item: Any) -> None:
        if item is None or isinstance(item, BaseException) or item.finished:
            self.items.put(item)


def replay_fleet_records(engine: EngineArgs, trace: list[TraceRequest], vocab_size: int,
                         router: Router) -> FleetReplay:
    """The trace through ``engine.data_parallel_size`` real replicas behind ``router``."""
    from twinserve.entrypoints.dp_front import DataParallelFront
    front = DataParallelFront(engine, "server", on_cuda=engine.device == "cuda", router=router,
                              record_steps=True)
    done = _Done()
    records: list[RequestRecord] = []  # (taken as they come: the front keeps a bounded few)
    steps: list[tuple[StepRecord, StepSample]] = []
    try:
        t0 = time.monotonic()
        for tr in sorted(trace, key=lambda r: r.arrival_time):
            time.sleep(max(0.0, tr.arrival_time - (time.monotonic() - t0)))
            params = SamplingParams(temperature=0, max_tokens=tr.output_tokens, ignore_eos=True)
            front.submit(tr.request_id, tr.prompt_token_ids(vocab_size, engine.block_size),
                         params, {"priority": tr.priority, "tenant": tr.tenant}, done)
            records += front.take_records()
            steps += front.take_steps()
        ends = 0
        while ends < 2 * len(trace):  # "accepted" then the final output (or an error)
            item = done.items.get(timeout=FINISH_TIMEOUT_S)
            if isinstance(item, BaseException):
                raise RuntimeError(f"a real request failed: {item}")
            ends += 1
            records += front.take_records()
            steps += front.take_steps()
        duration = time.monotonic() - t0
        records += _all_records(front, len(trace) - len(records))
        steps += front.take_steps()  # (those of the last steps came with their outputs)
        config = front.snapshot()[0].config or {}
        if front.shares_clock:  # (times from the first submission, as a replay's)
            for record in records:
                record.shift(front.time_origin - t0)
            for row, _ in steps:
                row.time += front.time_origin - t0
    finally:
        front.shutdown()
    steps.sort(key=lambda step: (step[0].time, step[0].replica))
    return FleetReplay(sorted(records, key=lambda r: (r.arrival_time, r.request_id)), duration,
                       dict(config), [row for row, _ in steps], [sample for _, sample in steps])


def _all_records(front: Any, n: int, timeout_s: float = 30.0) -> list[RequestRecord]:
    """The ``n`` records still to come of requests that ended: the last steps' records travel
    with the replicas' next messages (RuntimeError if they do not come within ``timeout_s``)."""
    records: list[RequestRecord] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} more records were due from the replicas; {len(records)} "
                               f"came within {timeout_s:g} s.")
        time.sleep(0.05)
        records += front.take_records()
    return records


def twin_config(engine: EngineArgs, router: str, profile: str) -> SimConfig:
    """The twin of ``engine``'s replicas behind ``router``, on ``profile``."""
    from twinserve.simulator import SimConfig
    return SimConfig(engine.replace(data_parallel_size=1, router="round-robin", device="cpu"),
                     hardware=profile, num_replicas=engine.data_parallel_size, router=router)


def profile_prices(engine: EngineArgs, profile: str) -> dict[str, float]:
    """The routers' constants read off the profile's step-time model, as the twin reads them
    (``simulator.router_prices``): the real front prices its replicas as the twin does."""
    from twinserve.simulator.router_prices import router_prices
    from twinserve.simulator.run import build_engine_config
    build = build_engine_config(twin_config(engine, "round-robin", profile))
    return router_prices(build.cost_model, build.engine_config.scheduler)


def write_real(replay: FleetReplay, engine: EngineArgs, out: Path,
               trace_desc: dict[str, Any]) -> dict[str, Any]:
    """``out`` as a run folder (backend ``twinserve``, a replica's resolved configuration, the
    fleet's keys) with its steps' samples (``step_features.csv``); returns its summary."""
    from twinserve.core.run_dir import write_run
    from twinserve.core.step_sample import SAMPLES_FILE, write_samples
    summary = summarize(replay.records, duration_s=replay.duration_s)
    config = {**replay.config, "backend": "twinserve", **trace_desc, "model": str(engine.model),
              "label": f"real {engine.router}", "router": engine.router,
              "data_parallel_size": engine.data_parallel_size,
              "data_parallel_backend": engine.data_parallel_backend,
              "wall_time_s": replay.duration_s}
    write_run(out, config, replay.records, summary, replay.steps)
    write_samples(out / SAMPLES_FILE, replay.samples)
    return summary


def simulate_fleet(engine: EngineArgs, trace: list[TraceRequest], router: str, profile: str,
                   out: Path, trace_desc: dict[str, Any],
                   prices: dict[str, float] | None = None) -> tuple[dict[str, Any], tuple[int, ...]]:
    """The twin of the fleet as the run folder ``out``: its summary and the requests each
    replica served. ``prices``: the router's constants (the real front's; default: read off
    ``profile``, as the twin reads them)."""
    from twinserve.routers import make_router
    from twinserve.simulator import simulate
    from twinserve.simulator.run import write_sim_run
    priced = None if prices is None else make_router(router, engine.block_size, prices)
    result = simulate(twin_config(engine, router, profile), trace, router=priced)
    write_sim_run(result, out, {**trace_desc, "profile": str(profile), "label": f"twin {router}"})
    return result.summary, served(result.records, engine.data_parallel_size)


def served(records: list[RequestRecord], replicas: int) -> tuple[int, ...]:
    """How many of ``records`` each replica served."""
    counts = Counter(r.replica for r in records)
    return tuple(counts.get(i, 0) for i in range(replicas))


def median_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Each of METRICS' median over the real runs' summaries."""
    return {key: statistics.median(float(s.get(key, float("nan"))) for s in summaries)
            for _, key, _ in METRICS}


def format_table(rows: list[FleetRow]) -> str:
    head = "| router | " + " | ".join(f"{m} real | {m} twin" for m, _, _ in METRICS) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(METRICS))]
    for row in rows:
        cells = []
        for _, key, unit in METRICS:
            for summary in (row.real, row.twin):
                value = float(summary.get(key, float("nan")))
                cells.append(f"{100 * value:.1f}%" if unit == "%" else f"{value:.1f} ms")
        lines.append(f"| {row.router} | " + " | ".join(cells) + " |")
    for row in rows:
        if row.real_served or row.twin_served:
            lines.append(f"requests per replica, {row.router}: real {list(row.real_served)}, "
                         f"twin {list(row.twin_served)}")
        if row.replay_speed == row.replay_speed:  # (not nan)
            lines.append(f"real steps, {row.router}: {row.replay_speed:.3f}x the profile's time "
                         "for the same steps")
    return "\n".join(lines)


def check_dp_validate(args: argparse.Namespace, engine: EngineArgs) -> None:
    """Refuses, by name, what a fleet's validate does not run."""
    refuse_fleet_flags(args, "--data-parallel-size")
    if not getattr(args, "profile", None):
        raise ValueError("validate --data-parallel-size needs --profile (a profile calibrated "
                         "with one thread, as each replica runs on its share of the cores).")
    if engine.enable_lora:
        raise ValueError("--enable-lora is not supported with --data-parallel-size.")
    if int(getattr(args, "real_repeats", 1) or 1) < 1:
        raise ValueError(f"--real-repeats must be >= 1, got {args.real_repeats}.")


def core_sharing(engine: EngineArgs, cores: int, on_cuda: bool) -> str | None:
    """Why the real fleet will run slower than its twin where, on a CPU, the replicas' worker
    ranks outnumber the cores (None where they do not): ranks then share cores, which a profile
    measured with a core per rank does not model."""
    world = replica_world(engine)
    ranks = engine.data_parallel_size * world
    if on_cuda or ranks <= cores:
        return None
    return (f"{engine.data_parallel_size} replicas x {world} worker ranks = {ranks} processes "
            f"on {cores} cores: ranks share cores, which the twin's profile (a core per rank) "
            "does not model; the real fleet will run slower than its twin.")


@dataclass(slots=True, frozen=True)
class FleetValidation:
    """One workload through real fleets and their twins, router after router: the trace (and
    what selected it), the model's vocabulary, the routers' prices and the twin's profile;
    ``at_replay_speed``: the twin on the profile scaled to the real runs' own speed (their
    steps' measured time over the profile's), as single-engine ``validate`` scales it."""

    trace: list[TraceRequest]
    desc: dict[str, Any]
    vocab_size: int
    prices: dict[str, float]
    profile: str
    repeats: int = 1
    log: Callable[[str], None] = print
    at_replay_speed: bool = False

    def router(self, engine: EngineArgs, where: Path) -> tuple[FleetRow, list[Path]]:
        """``engine``'s fleet (behind ``engine.router``): ``repeats`` real runs, each on a
        fresh fleet, and the twin, as run folders under ``where`` with ``errors.csv`` (the twin
        against the real runs' median, their speed against the profile's, their steps' time
        against the profile's prediction)."""
        from twinserve.fidelity.comparison import compare
        from twinserve.fidelity.replays import run_dir_name
        from twinserve.fidelity.validation import scaled_profile
        from twinserve.routers import make_router
        reals, folders = [], []
        real_served: tuple[int, ...] = ()
        for i in range(self.repeats):
            self.log(f"real: {engine.data_parallel_size} replicas behind {engine.router}, "
                     f"{len(self.trace)} requests (run {i + 1} of {self.repeats})")
            router = make_router(engine.router, engine.block_size, self.prices)
            replay = replay_fleet_records(engine, self.trace, self.vocab_size, router)
            folders.append(where / run_dir_name(i))
            reals.append(write_real(replay, engine, folders[-1], self.desc))
            real_served = real_served or served(replay.records, engine.data_parallel_size)
        model, profile = str(engine.model), self.profile
        if self.at_replay_speed:  # (the router keeps the real front's prices)
            profile = str(scaled_profile(Path(profile), folders, model, "replay", where,
                                         self.log))
        twin, twin_served = simulate_fleet(engine, self.trace, engine.router, profile,
                                           where / "sim", self.desc, self.prices)
        table = compare(where / "sim", folders, profile, model, speed_profile=self.profile,
                        title=f"sim vs real ({engine.router}, {len(folders)} real run(s), "
                              f"profile {profile})")
        table.write(where)
        speeds = table.speeds.get("replay") or [float("nan")]
        row = FleetRow(engine.router, median_summary(reals), twin, real_served, twin_served,
                       statistics.median(speeds))
        return row, [*folders, where / "sim"]


def run_validate_dp(args: argparse.Namespace, engine: EngineArgs,
                    trace: list[TraceRequest], trace_desc: dict[str, Any] | None = None) -> int:
    """The real fleet (``--real-repeats`` times) and its twin per router (``--router``,
    comma-separated names), as run folders under ``--out``; prints the table."""
    check_dp_validate(args, engine)
    with_adapter = next((tr for tr in trace if tr.lora is not None), None)
    if with_adapter is not None:
        raise ValueError(f"request {with_adapter.request_id!r} names LoRA adapter "
                         f"{with_adapter.lora!r}: not supported with --data-parallel-size.")
    from twinserve.core.model_config import ModelConfig
    from twinserve.entrypoints.dp_llm_engine import on_cuda
    from twinserve.gpu.models.default_model import resolve_model_source
    from twinserve.gpu.worker.cpu_cores import usable_cores
    sharing = core_sharing(engine, usable_cores(), on_cuda(engine))
    if sharing is not None:
        print(f"WARNING: {sharing}", file=sys.stderr)
    log: Callable[[str], None] = (lambda msg: None) if getattr(args, "quiet", False) else print
    prices = profile_prices(engine, args.profile)
    log("router prices from the profile: " + ", ".join(f"{k} {v:.4g}" for k, v in prices.items()))
    fleets = FleetValidation(
        trace, dict(trace_desc or {}),
        ModelConfig.from_dir(resolve_model_source(engine.model)[0]).vocab_size, prices,
        args.profile, int(getattr(args, "real_repeats", 1) or 1), log,
        bool(getattr(args, "at_replay_speed", False)))
    out, rows, folders = Path(args.out), [], []
    for router in [r for r in engine.router.split(",") if r]:
        row, written = fleets.router(engine.replace(router=router), out / router)
        rows.append(row)
        folders += written
    print(format_table(rows))
    try:
        from twinserve.reports import write_report
        title = f"twinserve validate: {engine.data_parallel_size} replicas"
        print(f"report: {write_report(folders, out / 'report.html', title=title)}")
    except Exception as exc:  # noqa: BLE001 (the table is the result, not the report)
        print(f"report not written: {exc}", file=sys.stderr)
    return 0
