"""Per-request records and run summaries under vLLM's benchmark conventions.

TTFT = first token - arrival; TPOT = (e2e - ttft) / (output_tokens - 1); ITL = every gap between
consecutive tokens; E2EL = finish - arrival. Summaries in milliseconds with vLLM's JSON keys
(``mean_ttft_ms``, ``p99_tpot_ms``, ``request_throughput``, ...), so a simulator run, a real-engine run
and a vLLM run compare column for column.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from operator import sub
from typing import Any, overload

import numpy as np

from twinserve.core.kv_offload import OffloadingStats
from twinserve.core.outputs import SchedulerOutput
from twinserve.core.request import Request
from twinserve.core.scheduler import Scheduler
from twinserve.core.token_times import TokenTimes

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class RequestRecord:
    """One finished request, in seconds since the start of the run (``nan`` where unknown)."""

    request_id: str
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finish_time: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    num_preemptions: int = 0
    tenant: str = "default"
    priority: int = 0
    lora: str = ""  # the LoRA adapter's name ("": the base model)
    finish_reason: str = "length"
    success: bool = True
    error: str = ""
    # speculative decoding (vLLM's names): verifications, drafts verified, drafts accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # seconds; a compact array (8 bytes a gap) since a long simulation holds millions of them
    itls: Sequence[float] = field(default_factory=lambda: array("d"))
    replica: int = 0  # the replica that served it, in a fleet (data parallelism, the twin's)

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def e2el(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def queue_time(self) -> float:
        return self.first_scheduled_time - self.arrival_time

    def shift(self, seconds: float) -> None:
        """Moves its times by ``seconds`` (onto another clock's origin), in place."""
        self.arrival_time += seconds
        self.first_scheduled_time += seconds
        self.first_token_time += seconds
        self.finish_time += seconds

    @classmethod
    def from_request(cls, req: Request, time_origin: float = 0.0,
                     replica: int = 0) -> RequestRecord:
        """Builds the record of a finished request; times are shifted by ``time_origin``.
        (Positional, in the fields' order: a replay builds one per request.)"""
        nan = math.nan
        scheduled, first, finish = req.first_scheduled_time, req.first_token_time, req.finish_time
        return cls(
            req.request_id, req.arrival_time - time_origin,
            nan if scheduled is None else scheduled - time_origin,
            nan if first is None else first - time_origin,
            nan if finish is None else finish - time_origin,
            req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens or 0,
            req.num_preemptions, req.tenant, req.priority, req.lora or "",
            req.finish_reason or "", first is not None, "", req.spec_num_drafts,
            req.spec_num_draft_tokens, req.spec_num_accepted_tokens, _gaps(req.token_times),
            replica)


def _gaps(times: Sequence[float] | TokenTimes) -> array:
    """Consecutive differences as a compact array: the same IEEE subtractions as a Python loop,
    done by numpy (a request has hundreds of tokens), on ``Request.token_times``' doubles as
    they lie (any other sequence is converted)."""
    if type(times) is TokenTimes:
        t = np.frombuffer(times.tobytes(), np.float64)
    else:
        t = (np.frombuffer(times, np.float64) if type(times) is array and times.typecode == "d"
             else np.fromiter(times, np.float64, len(times)))
    if t.size < 2:
        return array("d")
    return array("d", (t[1:] - t[:-1]).tobytes())


def _stats(name: str, values_s: np.ndarray | Sequence[float], owned: bool = False,
           ) -> dict[str, float]:
    """Mean, median, std and ``PERCENTILES`` (linear interpolation, as vLLM's numpy calls) in ms;
    NaNs (unknown values) are left out. ``owned``: ``values_s`` is a writable float64 array
    the caller hands over, scaled and partitioned in place: a whole trace's ITLs are millions,
    and each copy of them is fresh memory to fault in."""
    vals: np.ndarray
    if owned and isinstance(values_s, np.ndarray):
        vals = values_s
        vals *= 1000.0
    else:
        vals = np.asarray(values_s, dtype=np.float64) * 1000.0
    mean = float(vals.mean()) if vals.size else math.nan
    if math.isnan(mean):  # (a NaN among them makes their sum one)
        vals = vals[~np.isnan(vals)]
        mean = float(vals.mean()) if vals.size else math.nan
    if vals.size == 0:
        nan = math.nan
        return {f"mean_{name}_ms": nan, f"median_{name}_ms": nan, f"std_{name}_ms": nan,
                **{f"p{p}_{name}_ms": nan for p in PERCENTILES}}
    std = math.sqrt(_sum_of_squares(vals, mean) / vals.size)  # (before the partition reorders)
    qs = percentiles(vals, (50, *PERCENTILES), overwrite=True)
    out = {f"mean_{name}_ms": mean, f"median_{name}_ms": float(qs[0]), f"std_{name}_ms": std}
    out.update({f"p{p}_{name}_ms": float(q) for p, q in zip(PERCENTILES, qs[1:])})
    return out


# Elements of the deviations ``_sum_of_squares`` holds at a time: 64 KiB, under malloc's
# threshold for a fresh mapping, so it reuses memory where a whole-array temporary faults in pages.
_SQUARES_CHUNK = 8192


def _sum_of_squares(vals: np.ndarray, mean: float) -> float:
    """The sum of ``(vals - mean) ** 2`` exactly as ``np.var`` sums it, bit for bit, without its
    temporary of the array's size (a whole trace's ITLs are millions: each fresh copy is pages to
    fault in). numpy sums a contiguous float64 array pairwise, halving it (to a multiple of 8)
    down to blocks of 128; the halving is replayed here down to chunks of ``_SQUARES_CHUNK``, each
    summed by numpy itself. ``tests/core/test_metrics_summary.py`` compares it with ``np.std``."""
    scratch = np.empty(min(vals.size, _SQUARES_CHUNK))

    def part(lo: int, n: int) -> float:
        if n <= _SQUARES_CHUNK:
            dev = scratch[:n]
            np.subtract(vals[lo:lo + n], mean, out=dev)
            np.multiply(dev, dev, out=dev)
            return float(np.add.reduce(dev))
        half = n // 2
        half -= half % 8
        return part(lo, half) + part(lo + half, n - half)

    return part(0, vals.size)


def percentiles(values: np.ndarray, percents: Sequence[float], overwrite: bool = False,
                ) -> list[float]:
    """``np.percentile(values, percents).tolist()`` (its default, linear method) for a 1-D float64
    array without NaNs: the same order statistics (``np.partition``) and the same float
    arithmetic, step for step (numpy's ``_get_indexes``, ``_get_gamma`` and ``_lerp``), without
    the ``np.unique`` of its indexes, whose masked-array check imports ``numpy.ma`` (~20 ms of a
    simulator command's start). ``tests/core/test_metrics_percentiles.py`` compares the two.
    ``overwrite``: partition ``values`` in place (numpy's ``overwrite_input``), not a copy."""
    n = len(values)
    if not n:
        raise ValueError("percentiles of no values")
    picks: list[tuple[int, int, float]] = []  # (previous, next, gamma) of each percent
    for p in percents:
        virtual = (n - 1) * (p / 100)  # numpy: true_divide(q, 100), then (n - 1) * q
        if virtual >= n - 1:  # numpy's index -1 on both sides: the largest value
            picks.append((n - 1, n - 1, virtual - -1))
        elif virtual < 0:
            picks.append((0, 0, virtual - 0))
        else:
            below = math.floor(virtual)
            picks.append((below, below + 1, virtual - below))
    kth = sorted({0, n - 1, *(i for pick in picks for i in pick[:2])})
    if overwrite:
        values.partition(kth)
        part = values
    else:
        part = np.partition(values, kth)
    out = []
    for below, above, t in picks:
        a, b = float(part[below]), float(part[above])
        diff = b - a
        out.append(b - diff * (1 - t) if t >= 0.5 else a + diff * t)
    return out


def jain_index(values: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one gets everything."""
    if not values:
        return math.nan
    sq = sum(v * v for v in values)
    return (sum(values) ** 2) / (len(values) * sq) if sq > 0 else 1.0


def summarize(
    records: list[RequestRecord],
    duration_s: float | None = None,
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict[str, float | int | dict]:
    """The vLLM ``benchmark_serving`` result dict, plus preemptions, cache hits and tenants.

    ``duration_s`` defaults to last finish - first arrival. ``goodput_slos_ms`` maps any of
    ``ttft``, ``tpot``, ``e2el`` to a limit in ms; goodput counts requests meeting all of them.
    """
    ok = [r for r in records if r.success]
    if duration_s is None:
        duration_s = (max((r.finish_time for r in ok), default=0.0)
                      - min((r.arrival_time for r in records), default=0.0))
    duration_s = max(duration_s, 1e-9)
    in_tok = sum(r.input_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    summary: dict[str, float | int | dict] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tok / duration_s,
        "total_token_throughput": (in_tok + out_tok) / duration_s,
    }
    if goodput_slos_ms:
        good = sum(1 for r in ok if _meets(r, goodput_slos_ms))
        summary["request_goodput"] = good / duration_s
    ttft, tpot, e2el, queue = _latencies(ok)
    summary.update(_stats("ttft", ttft))
    summary.update(_stats("tpot", tpot))
    summary.update(_stats("itl", concatenated_itls([r.itls for r in ok]), owned=True))
    summary.update(_stats("e2el", e2el))
    summary.update(_stats("queue", queue))
    summary["num_preemptions"] = sum(r.num_preemptions for r in records)
    summary["prefix_cache_hit_rate"] = (
        sum(r.cached_tokens for r in ok) / in_tok if in_tok else 0.0)
    summary.update(tenant_summary(ok))
    summary.update(speculation_summary(records))
    return summary


def _latencies(records: list[RequestRecord]) -> tuple[np.ndarray | list[float], ...]:
    """Each record's ttft, tpot, e2el and queue time: in numpy (``record_latencies``) where
    every time is a float and every output count an int, else through the properties."""
    times = [[r.arrival_time for r in records], [r.first_scheduled_time for r in records],
             [r.first_token_time for r in records], [r.finish_time for r in records]]
    outputs = [r.output_tokens for r in records]
    if not records or any(set(map(type, col)) != {float} for col in times) \
            or set(map(type, outputs)) != {int}:
        return ([r.ttft for r in records], [r.tpot for r in records],
                [r.e2el for r in records], [r.queue_time for r in records])
    n = len(records)
    arrival, scheduled, first, finish = (np.fromiter(col, np.float64, n) for col in times)
    return record_latencies(arrival, scheduled, first, finish, np.fromiter(outputs, np.int64, n))


def record_latencies(arrival: np.ndarray, scheduled: np.ndarray, first: np.ndarray,
                     finish: np.ndarray, outputs: np.ndarray) -> tuple[np.ndarray, ...]:
    """``RequestRecord``'s ttft, tpot, e2el and queue_time over arrays of its fields (float64
    times, int64 output counts): the same float operations, element by element."""
    ttft, e2el = first - arrival, finish - arrival
    tpot = np.full(len(arrival), math.nan)
    decoded = outputs >= 2
    tpot[decoded] = (e2el[decoded] - ttft[decoded]) / (outputs[decoded] - 1)
    return ttft, tpot, e2el, scheduled - arrival


def concatenated_itls(itls: Sequence[Sequence[float]]) -> np.ndarray:
    """ITLs back to back in one float64 array: one copy of their bytes where all are compact
    arrays (``RequestRecord``'s own), else through ``np.asarray`` each."""
    if all(type(g) is array and g.typecode == "d" for g in itls):  # (writable: a bytearray)
        return np.frombuffer(bytearray().join(itls), dtype=np.float64)  # type: ignore[arg-type]
    return np.concatenate([np.asarray(g, dtype=np.float64) for g in itls] or [np.empty(0)])


def speculation_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """vLLM's speculative-decoding figures over the run (empty without verified drafts): the
    counts, the draft acceptance rate and the mean acceptance length (tokens per verification,
    the sampled one included)."""
    drafts = sum(r.spec_num_drafts for r in records)
    if not drafts:
        return {}
    draft_tokens = sum(r.spec_num_draft_tokens for r in records)
    accepted = sum(r.spec_num_accepted_tokens for r in records)
    return {"spec_num_drafts": drafts, "spec_num_draft_tokens": draft_tokens,
            "spec_num_accepted_tokens": accepted,
            "spec_draft_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "spec_mean_acceptance_length": 1.0 + accepted / drafts}


def kv_offload_summary(stats: Sequence[OffloadingStats]) -> dict[str, Any]:
    """The host KV tier's figures over the run, summed over replicas: vLLM's external prefix
    cache queries and hits (prompt tokens looked up in host, and found there) and their ratio,
    and the blocks the tier stored, loaded and evicted. ``prefix_cache_hit_rate`` counts the
    device's hits only; a host hit is counted here."""
    queries = sum(s.external_prefix_cache_queries for s in stats)
    hits = sum(s.external_prefix_cache_hits for s in stats)
    return {"external_prefix_cache_queries": queries, "external_prefix_cache_hits": hits,
            "external_prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "kv_offload_blocks_stored": sum(s.num_blocks_stored for s in stats),
            "kv_offload_blocks_loaded": sum(s.num_blocks_loaded for s in stats),
            "kv_offload_blocks_evicted": sum(s.num_blocks_evicted for s in stats)}


def peak_output_throughput(records: Sequence[RequestRecord]) -> float:
    """Output tokens of the busiest whole second since the start (vLLM's ``max_output_tokens_per_s``);
    a request's tokens are spread evenly over its chunks."""
    per_second: dict[int, float] = {}
    for r in records:
        if not r.success or math.isnan(r.first_token_time):
            continue
        times = [r.first_token_time]
        for gap in r.itls:
            times.append(times[-1] + gap)
        weight = r.output_tokens / len(times)
        for t in times:
            per_second[int(t)] = per_second.get(int(t), 0.0) + weight
    return max(per_second.values(), default=0.0)


def _meets(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    for key, limit in slos_ms.items():
        value = getattr(r, key) * 1000.0
        if not math.isnan(value) and value > limit:
            return False
    return True


def tenant_summary(records: list[RequestRecord]) -> dict[str, float | dict]:
    """Per-tenant service (input + 2 * output tokens, VTC's weights) and Jain's index over it."""
    service: dict[str, float] = {}
    for r in records:
        service[r.tenant] = service.get(r.tenant, 0.0) + r.input_tokens + 2.0 * r.output_tokens
    return {"tenant_service": service, "jain_index": jain_index(list(service.values()))}


@dataclass(slots=True)
class StepRecord:
    """One engine step: when it started, how long it took and what the engine held."""

    time: float
    duration: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preempted: int
    replica: int = 0
    # tokens computed this step per tenant: (prefill tokens, output tokens)
    tenant_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)


def _tenant_tokens(out: SchedulerOutput) -> dict[str, tuple[int, int]]:
    """Tokens computed per tenant in a step: (prefill tokens, output tokens)."""
    tenants: dict[str, tuple[int, int]] = {}
    for sr in out.scheduled:
        p, o = tenants.get(sr.request.tenant, (0, 0))
        tenants[sr.request.tenant] = (p + (sr.num_new_tokens if sr.is_prefill else 0), o + sr.sample)
    return tenants


class StepLog(Sequence[StepRecord]):
    """``StepRecord``s kept column by column: one compact array per numeric field
    (``_STEP_COLUMNS``; ``array("d")`` for times, durations and usage, 32-bit ``array("i")`` for
    counts), a step's values at one index. A simulation records hundreds of thousands of
    steps: the garbage collector walks no per-step object, a run of decode steps is a few
    ``extend``s, and a writer reads whole columns as numpy arrays without converting them.

    A value its column's array cannot hold as given (an int time such as SimPy's first 0, a
    bool or an out-of-range count, anything else) is kept as given in ``odd`` (by row, then
    column), its column holding a stand-in (the value as a float, else nan; 0 for counts), so
    reading the log gives back exactly what was recorded. Reading an element or iterating
    builds the ``StepRecord`` objects on the fly."""

    __slots__ = ("_cols", "_tenants", "_odd")

    def __init__(self, records: Iterable[StepRecord] = ()) -> None:
        self._cols: tuple[array, ...] = tuple(array(code) for code in _TYPECODES)
        self._tenants: dict[int, dict[str, tuple[int, int]]] = {}  # steps with tenant tokens only
        self._odd: dict[int, dict[int, Any]] = {}  # row -> {column: the value as recorded}
        for r in records:
            self.append(r)

    def append(self, r: StepRecord) -> None:
        if r.tenant_tokens:
            self._tenants[len(self._cols[0])] = r.tenant_tokens
        self._append_row((r.time, r.duration, r.num_seqs, r.num_prefill_tokens,
                          r.num_decode_tokens, r.num_running, r.num_waiting, r.kv_usage,
                          r.num_preempted, r.replica))

    def _append_row(self, row: tuple) -> None:
        i = len(self._cols[0])
        for k, (col, kind, value) in enumerate(zip(self._cols, _KINDS, row)):
            if type(value) is kind and (kind is float or -_INT32 <= value < _INT32):
                col.append(value)
            else:
                self._odd.setdefault(i, {})[k] = value
                col.append(_stand_in(value) if kind is float else 0)

    def record_step(self, out: SchedulerOutput, scheduler: Scheduler, start: float,
                    duration: float, replica: int = 0, with_tenants: bool = True) -> None:
        """Appends the record of a step just applied with ``update_from_output`` (without
        building a ``StepRecord``)."""
        if with_tenants:
            tenants = _tenant_tokens(out)
            if tenants:
                self._tenants[len(self._cols[0])] = tenants
        pool = scheduler.kv.pool
        total = len(pool.blocks)  # ``pool.usage``, inline: this runs every step
        usage = 1.0 - pool.free_queue.num_free / total if total else 0.0
        self._append_row((start, duration, len(out.scheduled), out.num_prefill_tokens,
                          out.num_decode_tokens, len(scheduler.running), len(scheduler.policy),
                          usage, len(out.preempted_request_ids), replica))

    def record_decode_run(self, requests: list[Request], scheduler: Scheduler, start: float,
                          ends: list[float], free_after: list[int], waiting: int,
                          replica: int = 0, with_tenants: bool = True,
                          num_finished: int = 0) -> None:
        """The rows of a run of decode-only steps of one batch (``requests``; a segment of a
        ``core.decode_run`` run) from ``start``: the rows ``record_step`` would have appended
        for each (``free_after``: free blocks after each; ``waiting``: the queue after the last,
        which requests may have joined while it ran, the run having started with none;
        ``num_finished``: requests the last step ended, no longer running after it)."""
        tenants: dict[str, tuple[int, int]] | None = None
        if with_tenants:
            tenants = {}
            for request in requests:
                tenants[request.tenant] = (0, tenants.get(request.tenant, (0, 0))[1] + 1)
        total = len(scheduler.kv.pool.blocks)
        n, k = len(requests), len(ends)
        if not k:
            return
        time, duration, seqs, prefill, decode, running, queued, kv, preempted, rep = self._cols
        if tenants:  # one dict shared by the run's rows
            first = len(time)
            self._tenants.update(dict.fromkeys(range(first, first + k), tenants))
        starts = [start, *ends[:-1]]
        usage = [1.0 - free / total for free in free_after] if total else [0.0] * k
        if not (type(start) is float and type(waiting) is int and type(replica) is int
                and type(num_finished) is int and set(map(type, ends)) == {float}
                and 0 <= waiting < _INT32 and 0 <= replica < _INT32 and 0 <= num_finished <= n):
            ns, zeros = [n] * k, [0] * k  # the plain rows, through the checks
            rows = list(zip(starts, map(sub, ends, starts), ns, zeros, ns, ns, zeros, usage,
                            zeros, [replica] * k))
            rows[-1] = (*rows[-1][:5], n - num_finished, waiting, *rows[-1][7:])
            for row in rows:
                self._append_row(row)
            return
        time.fromlist(starts)
        duration.fromlist(list(map(sub, ends, starts)))
        kv.fromlist(usage)
        ns, zeros = [n] * k, [0] * k
        seqs.fromlist(ns)
        decode.fromlist(ns)
        running.fromlist(ns)
        prefill.fromlist(zeros)
        queued.fromlist(zeros)
        preempted.fromlist(zeros)
        rep.fromlist([replica] * k)
        queued[-1] = waiting
        running[-1] = n - num_finished

    def sort_by_time(self) -> None:
        """Orders the rows by (start time, replica), in place: a fleet's replicas record their
        steps as each runs ahead, not in time order (one replica's rows already are)."""
        time, rep = self._cols[0], self._cols[-1]
        if len(time) < 2:
            return
        replicas = np.frombuffer(rep, _DTYPES[rep.typecode])
        odd_replicas = {i: values[9] for i, values in self._odd.items() if 9 in values}
        if odd_replicas:  # (sorted by their own numbers, as a plain list of them would be)
            replicas = replicas.astype(np.float64)
            for i, value in odd_replicas.items():
                replicas[i] = _stand_in(value)
        order = np.lexsort((replicas, np.frombuffer(time, np.float64)))
        self._cols = tuple(array(col.typecode, np.frombuffer(col, _DTYPES[col.typecode])
                                 [order].tobytes()) for col in self._cols)
        if self._tenants or self._odd:
            at = np.empty(len(order), np.int64)  # each row's new index
            at[order] = np.arange(len(order))
            self._odd = {int(at[old]): values for old, values in self._odd.items()}
            if self._tenants:
                new = at.tolist()
                self._tenants = {new[old]: tokens for old, tokens in self._tenants.items()}

    def clear(self) -> None:
        """Drops every row, in place."""
        for col in self._cols:
            del col[:]
        self._tenants.clear()
        self._odd.clear()

    def columns(self) -> tuple[array, ...]:
        """Every numeric field's column (``_STEP_COLUMNS``' order), stand-ins at the rows of
        ``odd()``: read-only views for fast writers."""
        return self._cols

    def odd(self) -> dict[int, dict[int, Any]]:
        """The values the columns hold stand-ins for, by row, then column (read-only)."""
        return self._odd

    def raw(self) -> tuple[list[tuple[float, float, int, int, int, int, int, float, int, int]],
                           dict[int, dict[str, tuple[int, int]]]]:
        """The rows (``StepRecord``'s fields but ``tenant_tokens``, in order) and the tenant
        tokens of the steps that have any, by row index."""
        return list(self._rows()), self._tenants

    def tenant_tokens(self) -> dict[int, dict[str, tuple[int, int]]]:
        """The tenant tokens of the steps that have any, by row index (read-only)."""
        return self._tenants

    def column(self, name: str) -> list[float] | list[int]:
        """One numeric field of every step, e.g. ``log.column("num_seqs")``."""
        k = _STEP_COLUMNS.index(name)
        values = self._cols[k].tolist()
        for i, odd in self._odd.items():
            if k in odd:
                values[i] = odd[k]
        return values

    def _rows(self) -> Iterator[tuple]:
        odd = self._odd
        for i, row in enumerate(zip(*self._cols)):
            found = odd.get(i) if odd else None
            yield row if found is None else tuple(found.get(k, v) for k, v in enumerate(row))

    def __len__(self) -> int:
        return len(self._cols[0])

    @overload
    def __getitem__(self, index: int) -> StepRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[StepRecord]: ...

    def __getitem__(self, index: int | slice) -> StepRecord | list[StepRecord]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = range(len(self))[index]  # negative indices, IndexError
        found = self._odd.get(i, {})
        return _step_record([found.get(k, col[i]) for k, col in enumerate(self._cols)],
                            self._tenants.get(i, {}))

    def __iter__(self) -> Iterator[StepRecord]:
        tenants = self._tenants
        for i, row in enumerate(self._rows()):
            yield _step_record(row, tenants.get(i, {}))


def _stand_in(value: Any) -> float:
    """What a float column holds for a value it keeps in ``StepLog.odd``: the value as a float
    (an int time's own number), else nan."""
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def _step_record(row: Sequence, tenants: dict[str, tuple[int, int]]) -> StepRecord:
    t, d, seqs, prefill, decode, running, waiting, kv, preempted, replica = row
    return StepRecord(t, d, seqs, prefill, decode, running, waiting, kv, preempted, replica,
                      tenants)


# StepRecord's numeric fields, in the order of StepLog's rows (all but tenant_tokens), and the
# array each is kept in: floats for times, durations and usage, 32-bit ints for counts.
_STEP_COLUMNS = tuple(f.name for f in fields(StepRecord) if f.name != "tenant_tokens")
_TYPECODES = tuple("d" if name in ("time", "duration", "kv_usage") else "i"
                   for name in _STEP_COLUMNS)
_KINDS = tuple(float if code == "d" else int for code in _TYPECODES)
_DTYPES: dict[str, np.dtype] = {"d": np.dtype(np.float64), "i": np.dtype(f"i{array('i').itemsize}")}
_INT32 = 1 << 31  # (counts past it are kept as given, beside their column)
