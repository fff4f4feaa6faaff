"""Measures the Peer connector on this machine: transfers of several sizes at several
concurrencies between two processes, through the same code path a decode engine's loads take
(``gpu/kv_transfer``: side channel, read, one indexed copy, done).

The fit (``fit_link``) is the twin's link model, ``seconds = latency + bytes / bandwidth``, least
squares over the one-at-a-time transfers; the concurrent rows show how far flows share the link
(their aggregate bandwidth) and are reported beside it, not fitted. ``calibrate`` writes the fit
into the profile as ``kv_link`` (``simulator/kv_transfer.py``'s ``LinkSpec``).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from twinserve.gpu.kv_transfer.consumer import Consumer, LoadJob, LoadResult
from twinserve.gpu.kv_transfer.producer import Producer
from twinserve.gpu.kv_transfer.region import KVLayout, SharedKVRegion

DEFAULT_BLOCKS = (1, 4, 16, 64)
DEFAULT_CONCURRENCY = (1, 2, 4)


@dataclass(slots=True, frozen=True)
class TransferSample:
    """One transfer: its bytes, the loads in flight with it, its wall time."""

    num_bytes: int
    concurrency: int
    seconds: float


@dataclass(slots=True, frozen=True)
class LinkFit:
    """``seconds = latency_s + bytes / bandwidth_bytes_per_s`` (the twin's ``LinkSpec``)."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def to_kv_link(self) -> dict[str, float]:
        return {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "latency_s": self.latency_s}


def fit_link(samples: Sequence[TransferSample]) -> LinkFit:
    """Least squares of seconds on bytes over each size's median one-at-a-time transfer (at
    least two sizes; medians, since a shared host stalls single transfers now and then); a
    negative intercept is clamped to 0 (the line then refitted through the origin)."""
    by_size: dict[int, list[float]] = {}
    for s in samples:
        if s.concurrency == 1:
            by_size.setdefault(s.num_bytes, []).append(s.seconds)
    if len(by_size) < 2:
        raise ValueError("samples: the fit needs one-at-a-time transfers of at least two sizes.")
    points = [(x, statistics.median(ys)) for x, ys in sorted(by_size.items())]
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    latency = mean_y - slope * mean_x
    if latency < 0:
        latency = 0.0
        slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    if slope <= 0:
        raise ValueError("samples: transfer time does not grow with size; measure larger ones.")
    return LinkFit(1.0 / slope, latency)


def aggregate_bandwidth(samples: Sequence[TransferSample]) -> dict[int, float]:
    """Per concurrency: bytes moved per second of the median transfer times the flows."""
    out = {}
    for c in sorted({s.concurrency for s in samples}):
        rows = [s for s in samples if s.concurrency == c]
        out[c] = c * statistics.median(s.num_bytes / s.seconds for s in rows)
    return out


def _producer_main(layout: KVLayout, conn: Any, device: str) -> None:
    region = SharedKVRegion(layout, torch.device(device))
    region.tensor.normal_()  # touched pages, as a cache that served prefills
    producer = Producer("measure-producer", region, "127.0.0.1", 0, timeout_s=60.0)
    conn.send(producer.port)
    while True:  # orders: ("publish", request_id, block_ids) or ("stop",)
        order = conn.recv()
        if order[0] == "stop":
            break
        producer.publications.publish(order[1], order[2], time.monotonic())
        conn.send("ok")
    producer.close()


def measure_transfers(layout: KVLayout, blocks: Sequence[int] = DEFAULT_BLOCKS,
                      concurrency: Sequence[int] = DEFAULT_CONCURRENCY, repeats: int = 5,
                      log: Callable[[str], None] | None = None,
                      device: str = "cpu") -> list[TransferSample]:
    """Loads of ``blocks`` blocks, ``concurrency`` at once, ``repeats`` rounds each, from a
    producer process into this one (both regions of ``layout`` on ``device``: shared memory on
    ``cpu``, CUDA IPC on ``cuda``)."""
    if max(blocks) * max(concurrency) > layout.num_blocks:
        raise ValueError(f"blocks: {max(blocks)} x {max(concurrency)} concurrent loads exceed "
                         f"the layout's {layout.num_blocks} blocks.")
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=_producer_main, args=(layout, theirs, device), daemon=True)
    process.start()
    local = SharedKVRegion(layout, torch.device(device))
    done: dict[str, LoadResult] = {}
    ready = threading.Condition()

    def on_result(result: LoadResult) -> None:
        with ready:
            done[result.request_id] = result
            ready.notify_all()
    consumer = Consumer(local.tensor, layout, max(concurrency), on_result)
    samples: list[TransferSample] = []

    def run_round(n: int, c: int, tag: str) -> list[LoadResult]:
        rids = [f"{tag}-{i}" for i in range(c)]
        for i, rid in enumerate(rids):
            ours.send(("publish", rid, list(range(i * n, (i + 1) * n))))
            ours.recv()
        deadline = time.monotonic() + 60
        for i, rid in enumerate(rids):
            ids = list(range(i * n, (i + 1) * n))
            consumer.submit(LoadJob(rid, rid, ids, ids, "127.0.0.1", port, deadline))
        with ready:
            ready.wait_for(lambda: all(rid in done for rid in rids), 60)
        results = [done.pop(rid) for rid in rids if rid in done]
        if len(results) < c or not all(x.ok for x in results):
            raise RuntimeError(f"a measured transfer failed: {[x.error for x in results]}")
        return results
    try:
        port = ours.recv()
        for w in range(3):  # every load thread connects and maps the producer's region once
            run_round(1, max(concurrency), f"warm{w}")
        for n in blocks:
            for c in concurrency:
                for r in range(repeats):
                    samples += [TransferSample(x.num_bytes, c, x.seconds)
                                for x in run_round(n, c, f"b{n}-c{c}-r{r}")]
                if log is not None:
                    mine = [s for s in samples if s.num_bytes == n * layout.bytes_per_block
                            and s.concurrency == c]
                    log(f"kv transfer: {n} blocks x {c}: median "
                        f"{statistics.median(s.seconds for s in mine) * 1e3:.2f} ms")
    finally:
        consumer.close()
        try:
            ours.send(("stop",))
        except OSError:
            pass
        process.join(5)
        if process.is_alive():
            process.kill()
    return samples


def measure_link(layout: KVLayout, log: Callable[[str], None] | None = None,
                 **kwargs: Any) -> tuple[LinkFit, list[TransferSample]]:
    """The fitted link and the samples it rests on."""
    samples = measure_transfers(layout, log=log, **kwargs)
    return fit_link(samples), samples
