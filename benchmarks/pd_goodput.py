"""Disaggregated prefill/decode in the twin: goodput per GPU, aggregated against xPyD.

For each workload (a slice of the Azure LLM 2023 code trace, long prompts and short outputs, and
of the conv trace) and each deployment at equal GPU counts (aggregated replicas behind a
least-outstanding router against 1P1D, 2P1D, 1P2D, 2P2D), the goodput: the highest Poisson
request rate at which at least ``--attainment`` of the requests meet both SLOs, found by doubling
the rate until a run fails, then bisecting. Goodput per GPU divides it by the GPUs (instances
times TP). p90 TTFT and TPOT are those of the run at the goodput rate.

SLOs, DistServe-like (DistServe set its SLOs a few times its model's unloaded latencies on its
GPU; the same here for Llama-3-8B on one H100, which the twin puts at a mean TTFT of ~24 ms for
a conv prompt (~930 tokens), ~55 ms (p90 ~150 ms) for a code prompt (~2,140 tokens), and a TPOT
of ~6 ms): conv TTFT 250 ms and TPOT 25 ms, code TTFT 500 ms and TPOT 25 ms. Llama-3-70B at TP 4
is about three times slower unloaded (TTFT ~64 ms conv, ~175 ms code; TPOT ~16.5 ms): its SLOs
are three times the 8B's, the same multiples of its own unloaded latencies.

    PYTHONPATH=... python -m twinserve.benchmarks.pd_goodput [--num-requests 400] [--models 8b,70b]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from twinserve.core.metrics import RequestRecord
from twinserve.simulator import SimConfig, simulate
from twinserve.traces import TraceRequest, first_n, load_trace


@dataclass(slots=True, frozen=True)
class Workload:
    name: str
    trace: str
    ttft_slo_ms: float
    tpot_slo_ms: float


@dataclass(slots=True, frozen=True)
class Deployment:
    """Aggregated replicas (``prefill`` = ``decode`` = 0) or an xPyD fleet."""

    name: str
    replicas: int = 1
    prefill: int = 0
    decode: int = 0

    def gpus(self, tp: int) -> int:
        return tp * (self.replicas if not self.prefill else self.prefill + self.decode)

    def config(self, model: str, tp: int, kv_link: str) -> SimConfig:
        common: dict[str, Any] = {"model": model, "hardware": "h100-sxm",
                                  "tensor_parallel_size": tp}
        if self.prefill:
            return SimConfig(**common, prefill_instances=self.prefill,
                             decode_instances=self.decode, kv_link=kv_link)
        return SimConfig(**common, num_replicas=self.replicas, router="least-outstanding")


WORKLOADS = (Workload("azure-code", "azure-code", 500.0, 25.0),
             Workload("azure-conv", "azure-conv", 250.0, 25.0))
DEPLOYMENTS = (  # grouped by GPU count (per TP group)
    Deployment("2x aggregated", replicas=2), Deployment("1P1D", prefill=1, decode=1),
    Deployment("3x aggregated", replicas=3), Deployment("2P1D", prefill=2, decode=1),
    Deployment("1P2D", prefill=1, decode=2),
    Deployment("4x aggregated", replicas=4), Deployment("2P2D", prefill=2, decode=2),
)
# model, TP, SLO scale (the SLOs' multiple of the 8B's: see the module docstring)
MODELS = {"8b": ("llama-3-8b", 1, 1.0), "70b": ("llama-3-70b", 4, 3.0)}


def poisson(trace: list[TraceRequest], rate: float, seed: int) -> list[TraceRequest]:
    """The trace's lengths, arriving as a Poisson process of ``rate`` requests/s."""
    rng, now, out = random.Random(seed), 0.0, []
    for tr in trace:
        out.append(dataclasses.replace(tr, arrival_time=now))
        now += rng.expovariate(rate)
    return out


def attainment(records: list[RequestRecord], w: Workload) -> float:
    """Share of requests meeting both SLOs (a one-token output has no TPOT: TTFT alone)."""
    ok = sum(1 for r in records if r.success and r.ttft * 1e3 <= w.ttft_slo_ms
             and (math.isnan(r.tpot) or r.tpot * 1e3 <= w.tpot_slo_ms))
    return ok / len(records)


def run(dep: Deployment, trace: list[TraceRequest], w: Workload, rate: float, model: str,
        tp: int, link: str, seed: int) -> tuple[float, dict[str, Any]]:
    result = simulate(dep.config(model, tp, link), poisson(trace, rate, seed))
    return attainment(result.records, w), result.summary


def goodput(dep: Deployment, trace: list[TraceRequest], w: Workload, model: str, tp: int,
            link: str, target: float, seed: int, steps: int) -> tuple[float, dict[str, Any]]:
    """The highest rate meeting ``target`` (doubling, then ``steps`` bisections) and its summary;
    (0, {}) when even the lowest rate tried fails."""
    low, high, best = 0.0, 0.5 * dep.gpus(tp), {}
    while True:
        att, summary = run(dep, trace, w, high, model, tp, link, seed)
        if att < target:
            break
        low, high, best = high, 2 * high, summary
        if high > 512:
            return low, best
    for _ in range(steps):
        mid = (low + high) / 2
        att, summary = run(dep, trace, w, mid, model, tp, link, seed)
        if att >= target:
            low, best = mid, summary
        else:
            high = mid
    return low, best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=400, help="requests of each trace slice")
    p.add_argument("--models", default="8b", help="comma-separated: 8b (TP 1), 70b (TP 4)")
    p.add_argument("--kv-link", default="nvlink")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--bisections", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t0 = time.process_time()
    print(f"SLO attainment >= {args.attainment:.0%}; {args.num_requests} requests per run, "
          f"Poisson arrivals; KV link {args.kv_link}; H100-SXM\n")
    print("| model | workload (SLOs) | deployment | GPUs | goodput req/s | per GPU | "
          "p90 TTFT ms | p90 TPOT ms | mean KV transfer ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in args.models.split(","):
        model, tp, scale = MODELS[key]
        for w in (dataclasses.replace(w, ttft_slo_ms=w.ttft_slo_ms * scale,
                                      tpot_slo_ms=w.tpot_slo_ms * scale) for w in WORKLOADS):
            trace = first_n(load_trace(w.trace), args.num_requests)
            for dep in DEPLOYMENTS:
                rate, s = goodput(dep, trace, w, model, tp, args.kv_link, args.attainment,
                                  args.seed, args.bisections)
                gpus = dep.gpus(tp)
                transfer = f"{s['mean_kv_transfer_ms']:.2f}" if "mean_kv_transfer_ms" in s else "-"
                print(f"| {model} TP{tp} | {w.name} ({w.ttft_slo_ms:g}/{w.tpot_slo_ms:g} ms) | "
                      f"{dep.name} | {gpus} | {rate:.2f} | {rate / gpus:.2f} | "
                      f"{_p90(s, 'ttft')} | {_p90(s, 'tpot')} | {transfer} |", flush=True)
    print(f"\nCPU {time.process_time() - t0:.0f} s")


def _p90(summary: dict[str, Any], metric: str) -> str:
    value = summary.get(f"p90_{metric}_ms")
    return "-" if value is None or not np.isfinite(value) else f"{value:.0f}"


if __name__ == "__main__":
    main()
