"""``twinserve validate --data-parallel-size N --router NAME --profile P``: one workload through
N real replicas behind the router and through the twin's N replicas behind the same router.

Real: the data-parallel front (``entrypoints/dp_front.py``) in real time; each trace request is
submitted when its arrival time comes (greedy, ``max_tokens`` = its output length,
``ignore_eos``), routed by the router, and its replica's ``RequestRecord`` measured on the
replica's own clock (the front-to-replica hop, well under a millisecond, is not in its TTFT).
Twin: ``simulator.simulate`` with ``num_replicas`` = N, the same router name and engine
settings, the profile (``--profile``; calibrated with one thread per replica) as hardware.
The table: mean and p99 TTFT, mean TPOT and prefix hit rate, real beside twin.
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twinserve.core.engine_args import EngineArgs
from twinserve.core.metrics import RequestRecord, summarize
from twinserve.core.sampling_params import SamplingParams
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
    """One router's real and twin summaries."""

    router: str
    real: dict[str, Any]
    twin: dict[str, Any]


class _Done:
    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item: Any) -> None:
        if item is None or isinstance(item, BaseException) or item.finished:
            self.items.put(item)


def replay_fleet(engine: EngineArgs, trace: list[TraceRequest], vocab_size: int,
                 prices: dict[str, float] | None = None) -> dict[str, Any]:
    """The trace through ``engine.data_parallel_size`` real replicas behind ``engine.router``
    (priced with ``prices``); their summary."""
    from twinserve.routers import make_router
    router = make_router(engine.router, engine.block_size, prices)
    records, duration = replay_fleet_records(engine, trace, vocab_size, router)
    return summarize(records, duration_s=duration)


def replay_fleet_records(engine: EngineArgs, trace: list[TraceRequest], vocab_size: int,
                         router: Router) -> tuple[list[RequestRecord], float]:
    """The trace through ``engine.data_parallel_size`` real replicas behind ``router``: the
    replicas' records by arrival, and the seconds from the first submission to the last end."""
    from twinserve.entrypoints.dp_front import DataParallelFront
    front = DataParallelFront(engine, "server", on_cuda=engine.device == "cuda", router=router)
    done = _Done()
    try:
        t0 = time.monotonic()
        for tr in sorted(trace, key=lambda r: r.arrival_time):
            time.sleep(max(0.0, tr.arrival_time - (time.monotonic() - t0)))
            params = SamplingParams(temperature=0, max_tokens=tr.output_tokens, ignore_eos=True)
            front.submit(tr.request_id, tr.prompt_token_ids(vocab_size, engine.block_size),
                         params, {}, done)
        ends = 0
        while ends < 2 * len(trace):  # "accepted" then the final output (or an error)
            item = done.items.get(timeout=FINISH_TIMEOUT_S)
            if isinstance(item, BaseException):
                raise RuntimeError(f"a real request failed: {item}")
            ends += 1
        duration = time.monotonic() - t0
        time.sleep(0.5)  # the last steps' records travel with the replicas' next messages
        records = front.take_records()
    finally:
        front.shutdown()
    return sorted(records, key=lambda r: r.arrival_time), duration


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


def simulate_fleet(engine: EngineArgs, trace: list[TraceRequest], router: str,
                   profile: str) -> dict[str, Any]:
    from twinserve.simulator import simulate
    return simulate(twin_config(engine, router, profile), trace).summary


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
    return "\n".join(lines)


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


def run_validate_dp(args: argparse.Namespace, engine: EngineArgs,
                    trace: list[TraceRequest]) -> int:
    """The real fleet and its twin per router (``--router``, comma-separated names)."""
    if not args.profile:
        raise ValueError("validate --data-parallel-size needs --profile (a profile calibrated "
                         "with one thread, as each replica runs on its share of the cores).")
    from twinserve.core.model_config import ModelConfig
    from twinserve.entrypoints.dp_llm_engine import on_cuda
    from twinserve.gpu.models.default_model import resolve_model_source
    from twinserve.gpu.worker.cpu_cores import usable_cores
    sharing = core_sharing(engine, usable_cores(), on_cuda(engine))
    if sharing is not None:
        print(f"WARNING: {sharing}", file=sys.stderr)
    vocab = ModelConfig.from_dir(resolve_model_source(engine.model)[0]).vocab_size
    prices = profile_prices(engine, args.profile)
    print("router prices from the profile: " + ", ".join(f"{k} {v:.4g}" for k, v in prices.items()))
    rows = []
    for router in [r for r in engine.router.split(",") if r]:
        one = engine.replace(router=router)
        rows.append(FleetRow(router, replay_fleet(one, trace, vocab, prices),
                             simulate_fleet(one, trace, router, args.profile)))
    print(format_table(rows))
    return 0
