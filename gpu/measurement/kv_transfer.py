"""Measures the Peer connector on this machine: transfers of several sizes at several
concurrencies between two processes, through the same code path a decode engine's loads take
(``gpu/kv_transfer``: side channel, read, one indexed copy, done).

``transfer_table`` reduces the samples to one row per (bytes, concurrency): the median seconds
from a round's submission to each load's end (what a request waiting for its KV sees). The fit
(``fit_link``) is the twin's link model: bandwidth and a fixed cost per transfer from the
one-at-a-time rows, and from the concurrent rows how much of that fixed cost concurrent
transfers share (``overhead``) rather than overlap (``latency``). On a CPU the Peer connector's
fixed cost is partly Python work on the consumer's core (side-channel calls, thread hand-offs
under the GIL), which concurrent loads cannot overlap. ``benchmarks/kv_link_fit.py`` fits on part
of the grid and predicts the rest with the twin. ``calibrate`` writes the fit into the profile
as ``kv_link`` (``simulator/kv_transfer.py``).

``measure_consumer`` measures what a P/D decode instance on one CPU core adds to that link (the
twin's CPU consumer rules): the cost of writing into pages of its region that nothing wrote
before, and the share of its speed a load keeps beside a step on the same core.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from twinserve.core.kv_link import LinkSpec
from twinserve.gpu.kv_transfer.consumer import Consumer, LoadJob, LoadResult
from twinserve.gpu.kv_transfer.producer import Producer
from twinserve.gpu.kv_transfer.region import KVLayout, SharedKVRegion, attach, copy_blocks

DEFAULT_BLOCKS = (1, 4, 16, 64)
DEFAULT_CONCURRENCY = (1, 2, 4)


@dataclass(slots=True, frozen=True)
class TransferSample:
    """One transfer: its bytes, the loads in flight with it, its seconds from its round's
    submission to its end."""

    num_bytes: int
    concurrency: int
    seconds: float


@dataclass(slots=True, frozen=True)
class TransferRow:
    """The median of one (bytes, concurrency) cell's samples, and how many there were."""

    num_bytes: int
    concurrency: int
    seconds: float
    num_samples: int


def transfer_table(samples: Sequence[TransferSample]) -> list[TransferRow]:
    """One row per (bytes, concurrency), sorted by both."""
    cells: dict[tuple[int, int], list[float]] = {}
    for s in samples:
        cells.setdefault((s.num_bytes, s.concurrency), []).append(s.seconds)
    return [TransferRow(b, c, statistics.median(ys), len(ys)) for (b, c), ys in sorted(cells.items())]


@dataclass(slots=True, frozen=True)
class LinkFit:
    """``seconds = latency_s + overhead_s + bytes / flow_rate`` for one transfer alone (the
    twin's ``LinkSpec``: concurrent transfers overlap their latency and share the link's
    ``bandwidth_bytes_per_s`` and the overhead, none above ``flow_bandwidth_bytes_per_s``;
    None: one flow fills the link)."""

    bandwidth_bytes_per_s: float
    latency_s: float
    overhead_s: float = 0.0
    flow_bandwidth_bytes_per_s: float | None = None
    first_touch_s_per_byte: float = 0.0  # a CPU consumer's (``measure_consumer``)
    consumer_step_share: float = 1.0

    @property
    def flow_rate(self) -> float:
        return self.flow_bandwidth_bytes_per_s or self.bandwidth_bytes_per_s

    def to_kv_link(self) -> dict[str, float]:
        """The profile's ``kv_link`` fields (``LinkSpec.to_dict``'s, defaults left out)."""
        link = LinkSpec("measured", self.bandwidth_bytes_per_s, self.latency_s,
                        overhead_s=self.overhead_s,
                        flow_bandwidth_bytes_per_s=self.flow_bandwidth_bytes_per_s,
                        first_touch_s_per_byte=self.first_touch_s_per_byte,
                        consumer_step_share=self.consumer_step_share)
        return {k: v for k, v in link.to_dict().items() if k not in ("name", "source")}

    def describe(self) -> str:
        text = (f"{self.flow_rate / 1e9:.2f} GB/s a flow, {self.bandwidth_bytes_per_s / 1e9:.2f} "
                f"GB/s shared, {self.latency_s * 1e3:.3f} ms latency, {self.overhead_s * 1e3:.3f} "
                "ms shared overhead")
        if self.first_touch_s_per_byte or self.consumer_step_share != 1.0:
            text += (f"; consumer: first touch {self.first_touch_s_per_byte * 1e12:.0f} us/MB, "
                     f"{self.consumer_step_share:.2f} of its speed beside a step")
        return text


# The capacities the fit tries, as multiples of one flow's rate: 1 to the highest concurrency
# fitted, in steps of 1% (beyond it, the fitted rows cannot tell capacities apart).
CAPACITY_STEP = 0.01


def fit_link(samples: Sequence[TransferSample], capacity: bool = True) -> LinkFit:
    """One flow's rate and the fixed cost from the one-at-a-time rows: least squares of seconds
    on bytes over each size's median (at least two sizes; medians, since a shared host stalls
    single transfers now and then); a negative intercept is clamped to 0 (the line then refitted
    through the origin). The concurrent rows, if any, then give the link's capacity (as ``rho``
    times one flow's rate, ``1 <= rho <=`` the highest concurrency among them) and split the
    fixed cost into the part concurrent transfers share (``overhead_s``) and the part they
    overlap (``latency_s``): the pair minimising the twin's squared relative error over them.
    ``capacity=False``: the link is one flow's rate (``rho = 1``, the model before flow caps)."""
    table = transfer_table(samples)
    slope, fixed = _one_at_a_time_line(table)
    concurrent = [r for r in table if r.concurrency > 1]
    if not concurrent:
        return LinkFit(1.0 / slope, fixed)
    steps = round((max(r.concurrency for r in concurrent) - 1) / CAPACITY_STEP) if capacity else 0
    best = min(_fit_share(concurrent, slope, fixed, 1.0 + k * CAPACITY_STEP)
               for k in range(steps + 1))
    _, rho, share = best
    return LinkFit(rho / slope, fixed * (1.0 - share), fixed * share, 1.0 / slope)


def _one_at_a_time_line(table: Sequence[TransferRow]) -> tuple[float, float]:
    """Seconds per byte and the fixed seconds of one transfer alone."""
    points = [(r.num_bytes, r.seconds) for r in table if r.concurrency == 1]
    if len(points) < 2:
        raise ValueError("samples: the fit needs one-at-a-time transfers of at least two sizes.")
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    fixed = mean_y - slope * mean_x
    if fixed < 0:
        fixed = 0.0
        slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    if slope <= 0:
        raise ValueError("samples: transfer time does not grow with size; measure larger ones.")
    return slope, fixed


def _fit_share(rows: Sequence[TransferRow], slope: float, fixed: float,
               rho: float) -> tuple[float, float, float]:
    """(squared relative error, rho, share) for a link of ``rho`` flows' rate: ``c`` equal flows
    started together each run at ``1 / k`` of a lone flow's rate, ``k = max(1, c / rho)``, and
    end at ``latency + k * (overhead + bytes * slope)``; with ``latency = (1 - share) * fixed``
    the residual ``t - fixed - k * bytes * slope = share * fixed * (k - 1)`` is linear in share
    (clamped to [0, 1])."""
    num = den = 0.0
    for r in rows:
        k = max(1.0, r.concurrency / rho)
        a = (k - 1.0) * fixed
        num += a * (r.seconds - fixed - k * r.num_bytes * slope) / r.seconds ** 2
        den += a * a / r.seconds ** 2
    share = min(1.0, max(0.0, num / den)) if den else 0.0
    error = 0.0
    for r in rows:
        k = max(1.0, r.concurrency / rho)
        predicted = fixed * (1.0 - share) + k * (share * fixed + r.num_bytes * slope)
        error += ((predicted - r.seconds) / r.seconds) ** 2
    return error, rho, share


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


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_transfers(layout: KVLayout, blocks: Sequence[int] = DEFAULT_BLOCKS,
                      concurrency: Sequence[int] = DEFAULT_CONCURRENCY, repeats: int = 5,
                      log: Callable[[str], None] | None = None,
                      device: str = "cpu", threads: int = 1) -> list[TransferSample]:
    """Loads of ``blocks`` blocks, ``concurrency`` at once, ``repeats`` rounds each, from a
    producer process into this one (both regions of ``layout`` on ``device``: shared memory on
    ``cpu``, CUDA IPC on ``cuda``). The rounds go through the grid once per repeat, so a burst
    of load on a shared host spreads over the cells rather than spoiling one. Torch runs on
    ``threads`` threads meanwhile: a P/D instance on one core of a CPU has one (two copies,
    each on a team of several, would time oversubscription, not the link)."""
    if max(blocks) * max(concurrency) > layout.num_blocks:
        raise ValueError(f"blocks: {max(blocks)} x {max(concurrency)} concurrent loads exceed "
                         f"the layout's {layout.num_blocks} blocks.")
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=_producer_main, args=(layout, theirs, device), daemon=True)
    process.start()
    local = SharedKVRegion(layout, torch.device(device))
    ended: dict[str, tuple[LoadResult, float]] = {}
    ready = threading.Condition()

    def on_result(result: LoadResult) -> None:
        with ready:
            ended[result.request_id] = (result, time.monotonic())
            ready.notify_all()
    consumer = Consumer(local.tensor, layout, max(concurrency), on_result)

    def run_round(n: int, c: int, tag: str, spread: bool = True) -> list[TransferSample]:
        rids = [f"{tag}-{i}" for i in range(c)]
        ids = [list(range(i * n, (i + 1) * n)) if spread else list(range(n)) for i in range(c)]
        for rid, mine in zip(rids, ids):
            ours.send(("publish", rid, mine))
            ours.recv()
        start = time.monotonic()
        for rid, mine in zip(rids, ids):
            consumer.submit(LoadJob(rid, rid, mine, mine, "127.0.0.1", port, start + 60))
        with ready:
            ready.wait_for(lambda: all(rid in ended for rid in rids), 60)
        results = [ended.pop(rid) for rid in rids if rid in ended]
        if len(results) < c or not all(x.ok for x, _ in results):
            raise RuntimeError(f"a measured transfer failed: {[x.error for x, _ in results]}")
        return [TransferSample(x.num_bytes, c, end - start) for x, end in results]
    samples: list[TransferSample] = []
    try:
        port = ours.recv()
        with _torch_threads(threads):
            # Every load thread connects, maps the producer's region and touches each page the
            # grid reads (a serving engine's threads did long ago): cold pages time page faults.
            for w in range(2):
                run_round(max(blocks) * max(concurrency), max(concurrency), f"warm{w}", False)
            for r in range(repeats):
                for n in blocks:
                    for c in concurrency:
                        samples += run_round(n, c, f"b{n}-c{c}-r{r}")
    finally:
        consumer.close()
        try:
            ours.send(("stop",))
        except OSError:
            pass
        process.join(5)
        if process.is_alive():
            process.kill()
    if log is not None:
        for row in transfer_table(samples):
            log(f"kv transfer: {row.num_bytes} bytes x {row.concurrency}: median "
                f"{row.seconds * 1e3:.3f} ms")
    return samples


def measure_link(layout: KVLayout, log: Callable[[str], None] | None = None,
                 consumer: bool = True, **kwargs: Any) -> tuple[LinkFit, list[TransferSample]]:
    """The fitted link and the samples it rests on; with ``consumer`` on a CPU, the consumer's
    rules measured too (``measure_consumer``)."""
    samples = measure_transfers(layout, log=log, **kwargs)
    fit = fit_link(samples)
    if consumer and kwargs.get("device", "cpu") == "cpu":
        found = measure_consumer(layout)
        if log is not None:
            log(f"kv consumer: {found}")
        fit = dataclasses.replace(fit, first_touch_s_per_byte=found.first_touch_s_per_byte,
                                  consumer_step_share=found.consumer_step_share)
    return fit, samples


@dataclass(slots=True, frozen=True)
class ConsumerFit:
    """A CPU consumer's rules (``simulator/kv_transfer.py``) and the medians they come from."""

    first_touch_s_per_byte: float
    consumer_step_share: float
    warm_s: float  # one load into pages written before, the core otherwise idle
    cold_s: float  # into pages never written
    cold_beside_step_s: float  # into pages never written, a stand-in step on the same core


# A decode step's kind of work for the stand-in: small GEMMs at a 135M model's width, one thread.
STEP_ROWS, STEP_WIDTH = 8, 576


def measure_consumer(layout: KVLayout, blocks: int = 16, repeats: int = 15) -> ConsumerFit:
    """Loads of ``blocks`` blocks within this process, on one core (the last this process may
    use), from a second mapping of a written region (as a consumer maps its producer's), in
    ``repeats`` rounds of three: blocks read and written before, blocks never read through the
    mapping nor written, and the latter while this thread runs a stand-in step (GEMMs, one torch
    thread) until the load ends. The
    first-touch cost is (cold - warm) per byte; the step share is cold / cold beside the step.
    The stand-in releases Python's lock within each GEMM, a real step also runs Python between
    them: the real share is somewhat lower (docs/disaggregation.md)."""
    fresh = dataclasses.replace(layout, num_blocks=blocks * (2 * repeats + 1))
    producer = SharedKVRegion(fresh, torch.device("cpu"))
    producer.tensor.normal_()  # every block written, as a producer's prefills wrote them
    src = attach(producer.handle(), torch.device("cpu"))  # a consumer's own mapping, unread
    dst = SharedKVRegion(fresh, torch.device("cpu"))
    ids = list(range(blocks))
    copy_blocks(src, ids, dst.tensor, ids)  # blocks 0..n-1 read and written once, the rest never
    x, w = torch.randn(STEP_ROWS, STEP_WIDTH), torch.randn(STEP_WIDTH, STEP_WIDTH)

    def step() -> None:
        (x @ w).relu_()
    times: dict[str, list[float]] = {"warm": [], "cold": [], "busy": []}
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {max(before)})  # this thread, and the load threads it starts
        with _torch_threads(1):
            for r in range(repeats):
                times["warm"].append(_timed_load(src, ids, dst.tensor, ids, None))
                for kind, busy in (("cold", None), ("busy", step)):
                    first = blocks * (1 + 2 * r + (kind == "busy"))
                    mine = list(range(first, first + blocks))
                    times[kind].append(_timed_load(src, mine, dst.tensor, mine, busy))
    finally:
        os.sched_setaffinity(0, before)
        del src
        producer.close()
        dst.close()
    warm, cold, busy = (statistics.median(times[k]) for k in ("warm", "cold", "busy"))
    touch = max(0.0, cold - warm) / (blocks * layout.bytes_per_block)
    return ConsumerFit(touch, min(1.0, cold / busy), warm, cold, busy)


def _timed_load(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int],
                busy: Callable[[], None] | None) -> float:
    """Seconds one copy takes on a thread of its own while this one runs ``busy`` (or waits)."""
    took: list[float] = []

    def load() -> None:
        start = time.perf_counter()
        copy_blocks(src, src_ids, dst, dst_ids)
        took.append(time.perf_counter() - start)
    thread = threading.Thread(target=load, name="twinserve-kv-measure")
    thread.start()
    while busy is not None and thread.is_alive():
        busy()
    thread.join()
    return took[0]
