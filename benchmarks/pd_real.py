"""Disaggregated prefill/decode for real on this machine: 1P1D (one core each) against one
engine with both cores, on one small workload (Poisson arrivals, fixed prompt and output
lengths), mean and p90 TTFT and TPOT; and the Peer connector's measured link.

    python -m twinserve.benchmarks.pd_real [--num-requests 24 --rate 1.0 --prompt-len 256
        --output-len 32]

Both sides run behind the same process front (``entrypoints/dp_front.py``): the aggregated
engine as one replica with two threads on both cores, the P/D pair as two processes pinned to
one core each, so only the deployment differs. TTFT: submit -> the first output with a token;
TPOT: (finish - first token) / (output tokens - 1).
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.core.sampling_params import SamplingParams


@dataclass(slots=True)
class _Timing:
    submitted: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    error: str | None = None
    items: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def put(self, item: Any) -> None:
        now = time.perf_counter()
        if isinstance(item, BaseException):
            self.error, self.done = str(item), now
        elif item is not None:
            if self.first is None and item.outputs[0].token_ids:
                self.first = now
            if item.finished:
                self.done, self.tokens = now, len(item.outputs[0].token_ids)
        self.items.put(item)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def run(front: Any, prompts: list[list[int]], rate: float, output_len: int,
        seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    timings = []
    t0 = time.perf_counter()
    at = 0.0
    for i, prompt in enumerate(prompts):
        at += rng.expovariate(rate)
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        timing = _Timing(time.perf_counter())
        front.submit(f"r{i}", prompt, params, {}, timing)
        timings.append(timing)
    deadline = time.perf_counter() + 600
    while any(t.done is None for t in timings) and time.perf_counter() < deadline:
        time.sleep(0.05)
    failed = [t for t in timings if t.error or t.done is None or t.first is None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0].error}")
    ttft = [(t.first - t.submitted) * 1e3 for t in timings]
    tpot = [(t.done - t.first) / (t.tokens - 1) * 1e3 for t in timings]
    return {"mean_ttft_ms": statistics.fmean(ttft), "p90_ttft_ms": _p90(ttft),
            "mean_tpot_ms": statistics.fmean(tpot), "p90_tpot_ms": _p90(tpot),
            "wall_s": time.perf_counter() - t0}


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-port", type=int, default=15400)
    ns = parser.parse_args()
    from twinserve.entrypoints.dp_front import DataParallelFront
    from twinserve.entrypoints.pd_front import DisaggregatedFront, PDDeployment
    args = EngineArgs(dtype="bfloat16", max_model_len=1024, max_num_seqs=32,
                      kv_cache_memory_bytes=256 << 20,
                      kv_transfer_config={"kv_port": ns.kv_port})
    prompts = _prompts(ns.num_requests, ns.prompt_len, ns.seed)
    print(f"{ns.num_requests} requests, {ns.prompt_len} in / {ns.output_len} out, "
          f"{ns.rate} req/s (Poisson, seed {ns.seed})")
    for name, make in (
            ("aggregated, 1 engine x 2 cores",
             lambda: DataParallelFront(args.replace(kv_transfer_config=None), "server", False)),
            ("1P1D, 1 core each",
             lambda: DisaggregatedFront(args, PDDeployment(1, 1), "server", False))):
        front = make()
        try:
            run(front, _prompts(2, ns.prompt_len, ns.seed + 1), 100.0, 4, ns.seed)  # warm-up
            result = run(front, prompts, ns.rate, ns.output_len, ns.seed)
        finally:
            front.shutdown()
        print(f"{name:32s} " + "  ".join(f"{k} {v:8.1f}" for k, v in result.items()))
    from twinserve.gpu.kv_transfer.region import KVLayout
    from twinserve.gpu.measurement.kv_transfer import aggregate_bandwidth, measure_link
    fit, samples = measure_link(KVLayout(30, 16, 3, 64, "bfloat16", 256))
    print(f"PeerConnector link (bundled model's blocks, 368,640 B each): "
          f"{fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s, latency {fit.latency_s * 1e3:.3f} ms, "
          f"shared overhead {fit.overhead_s * 1e3:.3f} ms; "
          "aggregate by concurrency: " + ", ".join(
              f"{c}: {bw / 1e9:.2f} GB/s" for c, bw in aggregate_bandwidth(samples).items()))


if __name__ == "__main__":
    main()
