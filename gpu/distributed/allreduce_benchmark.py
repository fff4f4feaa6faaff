"""The all-reduce on this machine's real backend, timed over message sizes and rank counts, and the
twin's communication term fitted to it.

    python -m twinserve.gpu.distributed.allreduce_benchmark [--ranks 2] [--hidden 576]

Each size is a step's hidden states, ``tokens x hidden`` elements of ``dtype``; rank 0 times
``repeats`` all-reduces after a barrier and keeps the median (the other ranks run the same loop in
spawned processes, one thread each). The twin's cost model charges one all-reduce of ``B`` bytes on
``p`` ranks ``latency + 2 (p - 1) / p * B / bandwidth`` (a ring's bus bandwidth, nccl-tests'
``busbw``); ``fit_interconnect`` finds ``bandwidth`` and ``latency`` by least squares.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from twinserve.gpu.distributed.parallel_state import GroupAddress, destroy_tp_group, host_store, init_tp_group

DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024)


@dataclass(frozen=True, slots=True)
class AllReduceSample:
    ranks: int
    nbytes: int
    seconds: float  # median of the repeats


@dataclass(frozen=True, slots=True)
class InterconnectFit:
    """The profile's ``interconnect_bandwidth`` (bytes/s) and ``interconnect_latency_s``."""

    bandwidth: float
    latency_s: float
    max_relative_error: float

    def predict(self, ranks: int, nbytes: int) -> float:
        return self.latency_s + 2 * (ranks - 1) / ranks * nbytes / self.bandwidth


def _loop(group, sizes: Sequence[int], dtype: torch.dtype, warmup: int,
          repeats: int) -> list[float]:
    barrier = torch.zeros(1)
    out = []
    for numel in sizes:
        x = torch.ones(numel, dtype=dtype)
        for _ in range(warmup):
            group.pg.allreduce([x]).wait()
        times = []
        for _ in range(repeats):
            group.pg.allreduce([barrier]).wait()
            t0 = time.perf_counter()
            group.pg.allreduce([x]).wait()
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def _peer(address: GroupAddress, rank: int, sizes: Sequence[int], dtype: torch.dtype,
          warmup: int, repeats: int) -> None:
    torch.set_num_threads(1)
    group = init_tp_group(address, rank, torch.device("cpu"))
    try:
        _loop(group, sizes, dtype, warmup, repeats)
    finally:
        destroy_tp_group(group)


def measure_all_reduce(ranks: int, hidden: int, tokens: Sequence[int] = DEFAULT_TOKENS,
                       dtype: torch.dtype = torch.float32, warmup: int = 3,
                       repeats: int = 20, timeout_s: float = 120.0) -> list[AllReduceSample]:
    """Gloo all-reduces of ``tokens x hidden`` elements on ``ranks`` local processes."""
    if ranks < 2:
        raise ValueError(f"ranks must be >= 2 to measure an all-reduce, got {ranks}.")
    sizes = [t * hidden for t in tokens]
    store = host_store(ranks, timeout_s)
    address = GroupAddress("127.0.0.1", store.port, ranks, "gloo", timeout_s)
    ctx = mp.get_context("spawn")
    peers = [ctx.Process(target=_peer, args=(address, r, sizes, dtype, warmup, repeats),
                         daemon=True) for r in range(1, ranks)]
    for p in peers:
        p.start()
    try:
        group = init_tp_group(address, 0, torch.device("cpu"), store)
        try:
            seconds = _loop(group, sizes, dtype, warmup, repeats)
        finally:
            destroy_tp_group(group)
    finally:
        for p in peers:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()
                p.join()
    elem = torch.empty(0, dtype=dtype).element_size()
    return [AllReduceSample(ranks, n * elem, s) for n, s in zip(sizes, seconds)]


def fit_interconnect(samples: Sequence[AllReduceSample]) -> InterconnectFit:
    """Least squares of ``seconds = latency + ring_bytes / bandwidth`` (latency >= 0)."""
    if len(samples) < 2:
        raise ValueError("fit_interconnect needs at least two samples.")
    ring = np.array([2 * (s.ranks - 1) / s.ranks * s.nbytes for s in samples])
    t = np.array([s.seconds for s in samples])
    # relative least squares: small messages (latency-bound) weigh as much as large ones
    a = np.stack([np.ones_like(ring), ring], axis=1) / t[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if latency < 0:
        latency, per_byte = 0.0, float(np.sum(ring / t) / np.sum((ring / t) ** 2))
    if per_byte <= 0:
        raise ValueError("the measured all-reduce does not grow with its size: cannot fit a "
                         "bandwidth (measure larger messages).")
    fit = InterconnectFit(1.0 / float(per_byte), float(latency), 0.0)
    errors = [abs(fit.predict(s.ranks, s.nbytes) / s.seconds - 1) for s in samples]
    return InterconnectFit(fit.bandwidth, fit.latency_s, max(errors))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    samples = [s for r in args.ranks for s in measure_all_reduce(r, args.hidden,
                                                                 repeats=args.repeats)]
    fit = fit_interconnect(samples)
    print(f"{'ranks':>5} {'bytes':>10} {'measured us':>12} {'fitted us':>10}")
    for s in samples:
        print(f"{s.ranks:>5} {s.nbytes:>10} {s.seconds * 1e6:>12.1f} "
              f"{fit.predict(s.ranks, s.nbytes) * 1e6:>10.1f}")
    print(f"interconnect_bandwidth {fit.bandwidth / 1e9:.2f} GB/s, interconnect_latency_s "
          f"{fit.latency_s * 1e6:.1f} us (max error {fit.max_relative_error:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
