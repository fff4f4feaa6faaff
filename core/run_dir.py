"""The run folder every backend writes and the reports read.

    RUN_DIR/
      config.json     what ran: backend (sim | twinserve | vllm), model, hardware, policy, trace, knobs
      requests.csv    one row per request (REQUEST_COLUMNS; times in seconds from the run start,
                      latencies in ms, ``itls_ms`` space-separated; then, where they apply,
                      SPEC_, REPLICA_ or PD_REQUEST_COLUMNS)
      steps.csv       one row per engine step (STEP_COLUMNS); absent for client-side runs
      tenants.csv     tokens served per step per tenant (time, tenant, prefill_tokens, output_tokens)
      summary.json    ``metrics.summarize`` (vLLM's benchmark keys)
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import is_
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from twinserve.core.metrics import (
    RequestRecord,
    StepLog,
    StepRecord,
    concatenated_itls,
    record_latencies,
)

REQUEST_COLUMNS = (
    "request_id", "tenant", "priority", "lora", "arrival_time", "first_scheduled_time",
    "first_token_time", "finish_time", "input_tokens", "output_tokens", "cached_tokens", "num_preemptions",
    "finish_reason", "success", "error", "ttft_ms", "tpot_ms", "e2el_ms", "queue_ms", "itls_ms",
)
# Appended to requests.csv when some request verified drafts (speculative decoding), so the
# files of runs without speculation stay as they were.
SPEC_REQUEST_COLUMNS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
# Appended to requests.csv by a fleet's runs (replicas behind a router, the twin's or the
# data-parallel front's): the replica that served each request.
REPLICA_REQUEST_COLUMNS = ("replica",)
# Appended to requests.csv by disaggregated (prefill/decode) runs only: where each request's
# prefill and decode ran, its KV load (consumer's load start -> finish, bytes) and the parts of
# its TTFT, which add up to it (DisaggregatedParts).
PD_REQUEST_COLUMNS = ("prefill_engine", "decode_engine", "kv_transfer_s", "kv_transfer_bytes",
                      "ttft_queue_s", "ttft_prefill_s", "ttft_transfer_s", "ttft_decode_s")
STEP_COLUMNS = (
    "time", "duration", "num_seqs", "num_prefill_tokens", "num_decode_tokens", "num_running",
    "num_waiting", "kv_usage", "num_preempted", "replica",
)
TENANT_COLUMNS = ("time", "tenant", "prefill_tokens", "output_tokens")


@dataclass(slots=True)
class DisaggregatedParts:
    """One request of a disaggregated run, in seconds from the run start (``nan``: never
    happened, e.g. a request whose prefill failed). ``load_start``/``load_end``: the consumer's
    KV load; a prompt the consumer's own cache held needs none (``load_end`` = ``prefill_done``,
    nothing moved). TTFT parts: arrival -> first prefill step (queue) -> prefill output
    (prefill) -> load finished (transfer: the wait for blocks, then the flow) -> first token."""

    prefill_engine: str
    decode_engine: str = ""
    arrival: float = math.nan
    prefill_start: float = math.nan
    prefill_done: float = math.nan
    load_start: float = math.nan
    load_end: float = math.nan
    kv_transfer_bytes: float = 0.0

    def row(self, first_token_time: float) -> tuple[Any, ...]:
        """The PD_REQUEST_COLUMNS values, given the request's first token time."""
        load_end = self.prefill_done if math.isnan(self.load_end) else self.load_end
        return (self.prefill_engine, self.decode_engine, self.load_end - self.load_start,
                int(self.kv_transfer_bytes), self.prefill_start - self.arrival,
                self.prefill_done - self.prefill_start, load_end - self.prefill_done,
                first_token_time - load_end)


def _fmt(x: float) -> str:
    """The plain float format of the run folder (``fmt`` is the fast one the writer uses)."""
    return "" if math.isnan(x) else repr(round(x, 9))


def fmt(x: float) -> str:
    """``_fmt(x)``, twice as fast where it matters (a whole trace writes millions of floats).

    ``f"{x:.9f}"`` holds the digits ``round(x, 9)`` rounds to (both are CPython's correctly
    rounded dtoa at 9 decimals); without its trailing zeros it is ``repr`` of that float as
    long as no shorter decimal lies within half an ulp of it, i.e. while the ulp is below 1e-9
    (``|x| < 1e6``), and as long as ``repr`` writes no exponent (``|x| >= 1e-4``). Elsewhere
    (and for nan, negatives, zero, ints) the plain format runs."""
    if 1e-4 <= x < 1e6 and type(x) is float:  # an int keeps repr's "5", not "5.0"
        s = f"{x:.9f}".rstrip("0")
        return s + "0" if s[-1] == "." else s
    return _fmt(x)


def _has_speculation(records: Sequence[RequestRecord]) -> bool:
    return any(r.spec_num_drafts for r in records)


def is_fleet(config: Mapping[str, Any]) -> bool:
    """Whether a run's configuration has several replicas behind a router (the twin's
    ``num_replicas``, the real ``data_parallel_size``): its requests.csv names each request's."""
    return max(int(config.get("num_replicas") or 1), int(config.get("data_parallel_size") or 1)) > 1


def _request_row(r: RequestRecord, speculation: bool = False,
                 fleet: bool = False) -> list[Any]:
    """The plain requests.csv row (``_write_requests`` writes the same, faster)."""
    tail = [r.spec_num_drafts, r.spec_num_draft_tokens, r.spec_num_accepted_tokens] \
        if speculation else []
    if fleet:
        tail.append(r.replica)
    return [
        r.request_id, r.tenant, r.priority, r.lora, _fmt(r.arrival_time),
        _fmt(r.first_scheduled_time), _fmt(r.first_token_time), _fmt(r.finish_time),
        r.input_tokens, r.output_tokens, r.cached_tokens, r.num_preemptions, r.finish_reason,
        int(r.success), r.error,
        _fmt(r.ttft * 1e3), _fmt(r.tpot * 1e3), _fmt(r.e2el * 1e3), _fmt(r.queue_time * 1e3),
        " ".join(f"{g * 1e3:.6g}" for g in r.itls), *tail,
    ]


def _write_requests(f: TextIO, records: list[RequestRecord],
                    parts: Mapping[str, DisaggregatedParts] | None = None,
                    step_times: Sequence[float] | None = None, fleet: bool = False) -> None:
    """requests.csv's rows as ``_request_row`` and csv.writer write them: each row's first
    fields from ``_row_heads`` (csv.writer's own where a row needs it), the ITL column (digits,
    dots, signs, spaces: never quoted) appended without csv's scan of every character.
    ``parts``: a disaggregated run's PD_REQUEST_COLUMNS, by request id; ``step_times``: the
    run's step start times, whose differences most ITL columns are (``_itl_texts``); ``fleet``:
    add REPLICA_REQUEST_COLUMNS."""
    speculation = _has_speculation(records)
    for r, head, itls in zip(records, _row_heads(records), _itl_columns(records, step_times)):
        if head is None:
            head = csv_fields((
                r.request_id, r.tenant, r.priority, r.lora, fmt(r.arrival_time),
                fmt(r.first_scheduled_time), fmt(r.first_token_time), fmt(r.finish_time),
                r.input_tokens, r.output_tokens, r.cached_tokens, r.num_preemptions,
                r.finish_reason, int(r.success), r.error,
                fmt(r.ttft * 1e3), fmt(r.tpot * 1e3), fmt(r.e2el * 1e3), fmt(r.queue_time * 1e3)))
        if speculation:
            itls += f",{r.spec_num_drafts},{r.spec_num_draft_tokens},{r.spec_num_accepted_tokens}"
        if fleet:
            itls += f",{r.replica}"
        if parts is not None:
            itls += _pd_text(parts.get(r.request_id), r.first_token_time)
        f.write(head + "," + itls + "\n")


def csv_fields(fields: Sequence[Any]) -> str:
    """csv.writer's text of ``fields`` without a line end. A field holding a carriage return or
    a newline is quoted: csv.writer quotes only its line terminator's characters, so one whose
    terminator is "" or "\\n" would write a bare "\\r" or "\\n" that breaks the row on reading."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\r\n").writerow(fields)
    return buf.getvalue()[:-2]


# What makes csv.writer quote a field (QUOTE_MINIMAL, its default dialect)
_QUOTED = re.compile('[,"\r\n]')


def _row_heads(records: list[RequestRecord]) -> list[str | None]:
    """The text csv.writer writes for each record's fields up to ``queue_ms`` (``_request_row``'s
    first 19), its floats formatted column by column in numpy (``_float_texts``). None for a
    record whose text fields csv would quote or whose fields are not of their declared types
    (str, int, float): ``_write_requests`` hands those to csv.writer."""
    n = len(records)
    texts: list[list] = [[r.request_id for r in records], [r.tenant for r in records],
             [r.lora for r in records], [r.finish_reason for r in records],
             [r.error for r in records]]
    ints = [[r.priority for r in records], [r.input_tokens for r in records],
            [r.output_tokens for r in records], [r.cached_tokens for r in records],
            [r.num_preemptions for r in records]]
    times = [[r.arrival_time for r in records], [r.first_scheduled_time for r in records],
             [r.first_token_time for r in records], [r.finish_time for r in records]]
    plain = np.ones(n, bool)
    for values, kind in [*((v, str) for v in texts), *((v, int) for v in ints),
                         *((v, float) for v in times)]:
        if set(map(type, values)) != {kind}:
            plain &= np.fromiter(map(is_, map(type, values), repeat(kind)), bool, n)
    for values in texts:  # (a column of str only, the common case: joined in C)
        strings = values if plain.all() else [v for v in values if type(v) is str]
        if _QUOTED.search("\x1f".join(strings)):
            plain &= np.fromiter((type(v) is str and not _QUOTED.search(v) for v in values),
                                 bool, n)
    outputs = ints[2]
    if not plain.all():  # (their heads are csv.writer's: placeholders here)
        keep = plain.tolist()
        texts = [[v if type(v) is str else "" for v in values] for values in texts]
        times = [[v if ok else math.nan for v, ok in zip(col, keep)] for col in times]
        outputs = [v if ok else 2 for v, ok in zip(outputs, keep)]
    arrival, scheduled, first, finish = (np.fromiter(col, np.float64, n) for col in times)
    ttft, tpot, e2el, queue = record_latencies(arrival, scheduled, first, finish,
                                               np.fromiter(outputs, np.int64, n))
    columns = [texts[0], texts[1], list(map(str, ints[0])), texts[2],
               *map(_float_texts, (arrival, scheduled, first, finish)),
               *(list(map(str, v)) for v in ints[1:]), texts[3],
               list(map(str, map(int, (r.success for r in records)))), texts[4],
               *(_float_texts(v * 1e3) for v in (ttft, tpot, e2el, queue))]
    heads: list[str | None] = list(map(",".join, zip(*columns)))
    for i in np.flatnonzero(~plain).tolist():
        heads[i] = None
    return heads


def _float_texts(x: np.ndarray) -> list[str]:
    """``fmt`` of each value (float64), those in its fast range formatted in numpy as
    ``_steps_text`` formats them."""
    fast = (x >= 1e-4) & (x < 1e6)
    out = _join_columns([_fixed_field(np.where(fast, x, 1.0), 9, True)]).split("\n")
    del out[-1]
    for i in np.flatnonzero(~fast).tolist():
        out[i] = fmt(float(x[i]))
    return out


def _pd_text(part: DisaggregatedParts | None, first_token_time: float) -> str:
    """``,``-led PD_REQUEST_COLUMNS of one request (empty cells for a request without parts)."""
    if part is None:
        return "," * len(PD_REQUEST_COLUMNS)
    values = part.row(first_token_time)
    return "," + ",".join(v if isinstance(v, str) else str(v) if isinstance(v, int) else _fmt(v)
                          for v in values)


def _itl_texts(records: list[RequestRecord], step_times: Sequence[float] | None = None,
               ) -> list[str]:
    """Each record's ITL column, ``" ".join(f"{g * 1e3:.6g}" for g in r.itls)``."""
    return list(_itl_columns(records, step_times))


def _itl_columns(records: list[RequestRecord], step_times: Sequence[float] | None = None,
                 ) -> Iterator[str]:
    """``_itl_texts``, one record's at a time (a writer writes each as it comes, so a whole
    trace's columns are never held at once). A whole trace holds millions of gaps but far
    fewer distinct ones: the requests decoding in one step share its gap. ``step_times``: the
    steps' start times (a run's ``StepLog`` column), from one text of whose differences most
    records' columns are cut (``_step_gap_spans``); the others' gaps are formatted once per
    distinct value (``_distinct_texts``)."""
    lengths = [len(r.itls) for r in records]
    text, spans = "", dict[int, tuple[int, int]]()
    if step_times is not None and any(lengths):
        text, spans = _step_gap_spans(records, lengths, step_times)
    rest = [i for i, n in enumerate(lengths) if n and i not in spans]
    others: dict[int, str] = {}
    if rest:
        texts, index = _distinct_texts(concatenated_itls([records[i].itls for i in rest]) * 1e3)
        each = (texts if index is None else texts[index]).tolist()
        start = 0
        for i in rest:
            n = lengths[i]
            others[i] = " ".join(each[start:start + n])
            start += n
    for i in range(len(records)):
        span = spans.get(i)
        yield text[span[0]:span[1]] if span is not None else others.get(i, "")


def _distinct_texts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """``f"{g:.6g}"`` of each distinct value (an object array, ``_g6_texts``) and each value's
    index among them (None: the texts are the values' own, in order: a -0.0, which
    ``np.unique``'s order would merge into 0.0). The same IEEE values as the plain per-value
    format, so the same texts."""
    zero = values == 0
    if zero.any() and np.signbit(values[zero]).any():
        return _g6_texts(values), None
    distinct = np.sort(values)  # np.unique(values, return_inverse=True), without its argsort
    keep = np.empty(len(distinct), bool)
    if len(keep):
        keep[0] = True
    np.not_equal(distinct[1:], distinct[:-1], out=keep[1:])  # (each nan kept: all "nan")
    distinct = distinct[keep]
    index = np.searchsorted(distinct, values)  # its first equal entry (nan: the first nan)
    return _g6_texts(distinct), index


_POWERS = 10.0 ** np.arange(10)  # (exact doubles)


def _g6_texts(x: np.ndarray) -> np.ndarray:
    """``f"{g:.6g}"`` of each value (an object array). Where that is fixed notation (``1e-4 <= g < 999999``)
    it is built in numpy: the value's six significant digits ``n`` are ``g * 10**k`` rounded,
    ``k = 5 - floor(log10(g))`` (as ``_fixed_field``'s digits, the product rounding as the
    exact value does but within an ulp of a tie), written as ``n / 10**k`` without trailing
    zeros (nor a point when no decimal is left). A value whose ``n`` is not six digits (a
    misjudged exponent, one rounding up to a power of ten), a near tie or a value outside that
    range gets the format itself."""
    out = np.empty(len(x), dtype=object)
    fast = (x >= 1e-4) & (x < 999999)
    k = np.zeros(len(x), np.int64)
    k[fast] = 5 - np.floor(np.log10(x[fast])).astype(np.int64)
    fast &= (k >= 0) & (k <= 9)
    y = np.where(fast, x, 1.0) * _POWERS[np.where(fast, k, 0)]
    n = np.rint(y)
    fast &= (n >= 1e5) & (n < 1e6) & (np.abs(y - np.floor(y) - 0.5) > np.spacing(y))
    n = n.astype(np.int64)
    for decimals in np.flatnonzero(np.bincount(k[fast], minlength=10)).tolist():  # (no np.unique:
        # its masked-array check imports numpy.ma, a good part of a short run's imports)
        rows = np.flatnonzero(fast & (k == decimals))
        whole, frac = np.divmod(n[rows], 10 ** decimals)
        fields = [_int_field(whole)]
        if decimals:
            digits = _digits(frac, decimals)
            seen = digits[:, -1] != 48  # a decimal is written where it or one after is not 0
            digits[:, -1] *= seen
            for j in range(decimals - 2, -1, -1):
                seen |= digits[:, j] != 48
                digits[:, j] *= seen
            fields += [(seen * ord("."))[:, None].astype(np.uint8), digits]
        texts = _join_columns([fields]).split("\n")
        del texts[-1]
        out[rows] = texts
    for i in np.flatnonzero(~fast).tolist():
        out[i] = f"{float(x[i]):.6g}"
    return out


# Records whose gaps are checked together against the steps' (a few MB of gaps at a time)
_RECORDS_PER_CHECK = 2048


def _step_gap_spans(records: list[RequestRecord], lengths: list[int],
                    step_times: Sequence[float]) -> tuple[str, dict[int, tuple[int, int]]]:
    """One text of the differences of consecutive step start times, formatted once each, and
    where each record's ITL column lies in it (by record index), for every record whose gaps
    are, bit for bit, those differences from the step that starts at its first token: a
    request that decodes in every step of a busy engine (one replica's, whose steps start
    where the last one ended). Every gap is compared, so a record whose gaps are not those (a
    fleet's interleaved steps, an idle engine, a preemption) has no span."""
    try:
        times = (np.frombuffer(step_times, np.float64)
                 if isinstance(step_times, array) and step_times.typecode == "d"
                 else np.fromiter(step_times, np.float64, len(step_times)))
    except (TypeError, ValueError, OverflowError):  # (not numbers: no gaps of theirs)
        return "", {}
    if len(times) < 2 or not (times[1:] >= times[:-1]).all():
        return "", {}
    diffs = times[1:] - times[:-1]
    first = np.fromiter([r.first_token_time for r in records], np.float64, len(records))
    steps = np.minimum(np.searchsorted(times, first), len(diffs))  # its first token's step
    counts = np.array(lengths)
    fits = np.flatnonzero((counts > 0) & (steps + counts <= len(diffs))).tolist()
    at = steps.tolist()
    matched: list[int] = []
    for c in range(0, len(fits), _RECORDS_PER_CHECK):
        chunk = fits[c:c + _RECORDS_PER_CHECK]
        got = concatenated_itls([records[i].itls for i in chunk])
        want = np.concatenate([diffs[at[i]:at[i] + lengths[i]] for i in chunk])
        differ = np.flatnonzero(want.view(np.int64) != got.view(np.int64))  # (bits: -0.0, nan)
        missed = set(np.searchsorted(np.cumsum(counts[chunk]), differ, side="right").tolist())
        matched += [i for k, i in enumerate(chunk) if k not in missed]
    if not matched:
        return "", {}
    text, offsets = _joined_texts(diffs * 1e3)
    return text, {i: (offsets[at[i]], offsets[at[i] + lengths[i]] - 1) for i in matched}


def _joined_texts(values: np.ndarray) -> tuple[str, list[int]]:
    """``" ".join(f"{g:.6g}" for g in values) + " "`` and where each value's text starts
    (a last entry: the text's length). The distinct values' texts (``_distinct_texts``) as a
    table of ASCII codes, a row each, gathered in the values' order: hundreds of thousands of
    values without a string object each."""
    texts, index = _distinct_texts(values)
    if index is None:
        index = np.arange(len(texts))
    table = np.array(texts.tolist(), dtype="S")  # (zero-padded: each text is ASCII)
    width = table.dtype.itemsize
    chars = np.zeros((len(texts), width + 1), np.uint8)
    chars[:, :width] = table.view(np.uint8).reshape(len(texts), width)
    sizes = np.count_nonzero(chars, axis=1)[index]
    rows = chars[index]
    rows[np.arange(len(index)), sizes] = ord(" ")
    flat = rows.ravel()
    offsets = np.zeros(len(index) + 1, np.int64)
    np.cumsum(sizes + 1, out=offsets[1:])
    return flat[flat != 0].tobytes().decode("ascii"), offsets.tolist()


def write_run(
    out_dir: str | Path,
    config: dict[str, Any],
    records: list[RequestRecord],
    summary: dict[str, Any],
    steps: Sequence[StepRecord] | None = None,
    disaggregated: Mapping[str, DisaggregatedParts] | None = None,
) -> Path:
    """Writes a run folder (creating it) and returns its path. Output is byte-identical for
    identical inputs (sorted keys, fixed float formatting). ``disaggregated``: a P/D run's
    parts by request id (adds PD_REQUEST_COLUMNS); a fleet's (``is_fleet``) adds
    REPLICA_REQUEST_COLUMNS."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    (out / "summary.json").write_text(json.dumps(_clean(summary), indent=2, sort_keys=True) + "\n")
    log = None if steps is None else steps if isinstance(steps, StepLog) else StepLog(steps)
    with open(out / "requests.csv", "w", newline="") as f:
        columns = REQUEST_COLUMNS + (SPEC_REQUEST_COLUMNS if _has_speculation(records) else ())
        fleet = disaggregated is None and is_fleet(config)
        if fleet:
            columns += REPLICA_REQUEST_COLUMNS
        if disaggregated is not None:
            columns += PD_REQUEST_COLUMNS
        csv.writer(f, lineterminator="\n").writerow(columns)
        _write_requests(f, records, disaggregated, None if log is None else log.columns()[0],
                        fleet)
    if log is not None:
        _write_steps(out, log)
    return out


def _write_steps(out: Path, steps: Sequence[StepRecord]) -> None:
    with open(out / "steps.csv", "w", newline="") as f, \
            open(out / "tenants.csv", "w", newline="") as g:
        ws = csv.writer(f, lineterminator="\n")
        ws.writerow(STEP_COLUMNS)
        g.write(csv_fields(TENANT_COLUMNS) + "\n")
        log = steps if isinstance(steps, StepLog) else StepLog(steps)
        columns, tenants, odd = log.columns(), log.tenant_tokens(), log.odd()
        # all numbers: the text csv.writer writes, without its per-field quoting checks
        for text in _steps_chunks(columns, odd):
            f.write(text)
        times = columns[0]
        for i in sorted(tenants):
            time, per_tenant = fmt(odd[i].get(0, times[i]) if i in odd else times[i]), tenants[i]
            g.writelines(csv_fields((time, tenant, *per_tenant[tenant])) + "\n"
                         for tenant in sorted(per_tenant))


def _step_line(row: Sequence) -> str:
    """One steps.csv line from a ``StepLog`` row (``_write_steps_reference``'s text)."""
    t, d, n, p, dec, run, wait, kv, pre, rep = row
    return f"{fmt(t)},{fmt(d)},{n},{p},{dec},{run},{wait},{kv:.6f},{pre},{rep}\n"


# ---- steps.csv's text in numpy: hundreds of thousands of rows -------------------------------
# A field is a matrix of ASCII codes, a row per step and a column per character, holding 0 where
# it writes nothing (leading and stripped zeros); a chunk's fields side by side, without the 0s,
# are its lines back to back.
_CHUNK_ROWS = 1 << 16
_PLACEHOLDER_END = 1  # ends a line that is replaced (a code no field writes)


def _steps_text(columns: Sequence[Sequence], odd: Mapping[int, Mapping[int, Any]] | None = None,
                ) -> str:
    """``"".join(map(_step_line, rows))``, built column-wise (``_steps_chunks``)."""
    return "".join(_steps_chunks(columns, odd))


def _steps_chunks(columns: Sequence[Any],
                  odd: Mapping[int, Mapping[int, Any]] | None = None) -> Iterator[str]:
    """The lines of the steps, ``_CHUNK_ROWS`` at a time (a writer writes each as it comes, so
    a whole trace's text is never held at once): ``columns`` are a ``StepLog``'s (its arrays,
    and ``odd``: the values their stand-ins replace, by row and column) or plain lists. The
    lines of rows holding anything but non-negative ``int`` counts and ``float`` times,
    durations and usage in ``fmt``'s fast range are ``_step_line``'s own."""
    num_rows = len(columns[0])
    if not num_rows:
        return
    slow = np.zeros(num_rows, bool)
    if odd is not None:  # a StepLog's arrays: as numpy arrays, without converting a value
        t, d, n, p, dec, run, wait, kv, pre, rep = (
            np.frombuffer(col, np.float64 if k in (0, 1, 7) else f"i{col.itemsize}").copy()
            for k, col in enumerate(columns))
        slow[list(odd)] = True
        for v in (n, p, dec, run, wait, pre, rep):
            slow |= (v < 0) | (v >= 10 ** 18)
    else:
        t, d, n, p, dec, run, wait, kv, pre, rep = (
            _typed_column(col, float if k in (0, 1, 7) else int, slow)
            for k, col in enumerate(columns))
    slow |= ~((t >= 1e-4) & (t < 1e6) & (d >= 1e-4) & (d < 1e6) & (kv >= 0) & (kv < 1e6))
    slow |= np.signbit(kv)
    ints = [n, p, dec, run, wait, pre, rep]
    for v in (t, d, kv, *ints):  # placeholders: those lines are replaced
        v[slow] = 1
    line_ends = np.where(slow, _PLACEHOLDER_END, ord("\n")).astype(np.uint8)
    for a in range(0, num_rows, _CHUNK_ROWS):
        part = slice(a, a + _CHUNK_ROWS)
        text = _join_columns([
            _fixed_field(t[part], 9, True), _fixed_field(d[part], 9, True),
            *([_int_field(v[part])] for v in ints[:5]), _fixed_field(kv[part], 6, False),
            *([_int_field(v[part])] for v in ints[5:])], line_ends[part])
        replaced = (a + np.flatnonzero(slow[part])).tolist()
        if not replaced:
            yield text
            continue
        # each piece but the last ends with a placeholder line, whose own text replaces it
        pieces = text.split(chr(_PLACEHOLDER_END))
        for k, i in enumerate(replaced):
            row = [c[i] for c in columns]
            for column, value in (odd or {}).get(i, {}).items():
                row[column] = value
            piece = pieces[k]
            pieces[k] = piece[:piece.rfind("\n") + 1] + _step_line(row)
        yield "".join(pieces)


def _typed_column(values: list, kind: type, odd: np.ndarray) -> np.ndarray:
    """``values`` as a float64 (``kind`` float) or int64 array; entries of another type (or
    ints outside [0, 10**18)) are marked in ``odd`` and left as placeholders (in a copy)."""
    n = len(values)
    other: list[int] = []
    types = set(map(type, values))
    if types == {float, int} and kind is float:  # (SimPy's clock starts at the int 0)
        found = _ints_among_floats(values)
        if found is not None:
            array, other = found
            odd[other] = True
            array[other] = 1.0
            return array
    if types != {kind}:
        other = np.flatnonzero(~np.fromiter(map(is_, map(type, values), repeat(kind)), bool,
                                            n)).tolist()
    elif kind is int:  # (no sign, int64): the bounds checked on the array, in C
        ints: np.ndarray | None
        try:
            ints = np.fromiter(values, np.int64, n)
        except OverflowError:
            ints = None
        if ints is not None and (not n or (ints.min() >= 0 and ints.max() < 10 ** 18)):
            return ints
        other = [i for i, v in enumerate(values) if not 0 <= v < 10 ** 18]
    if other:
        odd[other] = True
        values = list(values)
        for i in other:
            values[i] = kind(1)
    return np.fromiter(values, np.float64 if kind is float else np.int64, n)


def _ints_among_floats(values: list) -> tuple[np.ndarray, list[int]] | None:
    """``values`` (floats and ints) as float64 and where the ints are, found among the whole
    values only (None: an int too large for a float)."""
    try:
        array = np.fromiter(values, np.float64, len(values))
    except OverflowError:
        return None
    whole = np.flatnonzero(array == np.floor(array)).tolist()
    return array, [i for i in whole if type(values[i]) is not float]


def _int_field(v: np.ndarray) -> np.ndarray:
    """Non-negative integers in decimal, without leading zeros."""
    width = len(str(int(v.max()))) if v.size else 1
    digits = _digits(v, width)
    for j in range(width - 1):  # a leading zero: a power of ten above the value
        digits[:, j] *= v >= 10 ** (width - 1 - j)
    return digits


def _digits(v: np.ndarray, width: int) -> np.ndarray:
    """The last ``width`` decimal digits of non-negative integers as ASCII codes, most
    significant first. One division by the scalar 10 per digit, on int32 where the values fit
    (``width`` <= 9): numpy divides by a scalar several times faster than by a broadcast array
    of powers, and int32 faster than int64."""
    rest = v.astype(np.int32) if width <= 9 else v
    out = np.empty((len(v), width), np.uint8)
    for j in range(width - 1, 0, -1):
        rest, digit = np.divmod(rest, 10)
        out[:, j] = digit
    out[:, 0] = rest % 10
    out += 48
    return out


def _fixed_field(x: np.ndarray, decimals: int, strip: bool) -> list[np.ndarray]:
    """``"%.{decimals}f" % x`` of non-negative floats (``strip``: trailing zeros dropped but
    one, as ``fmt`` does), as the fields integer part, point and decimals. The digits are those of
    ``x * 10**decimals`` rounded to an integer: the float product lies within half an ulp of
    the exact one, so it rounds the same way except within an ulp of a tie, where the digits
    come from ``%`` itself."""
    y = x * 10.0 ** decimals
    n = np.rint(y).astype(np.int64)
    for i in np.flatnonzero(np.abs(y - np.floor(y) - 0.5) <= np.spacing(y)).tolist():
        n[i] = int(f"{float(x[i]):.{decimals}f}".replace(".", ""))
    whole, frac = np.divmod(n, 10 ** decimals)
    digits = _digits(frac, decimals)
    if strip:  # a decimal is written where it or one after it is not 0
        seen = digits[:, -1] != 48
        digits[:, -1] *= seen
        for j in range(decimals - 2, 0, -1):
            seen |= digits[:, j] != 48
            digits[:, j] *= seen
    return [_int_field(whole), np.full((len(x), 1), ord("."), np.uint8), digits]


def _join_columns(columns: list[list[np.ndarray]], line_ends: np.ndarray | None = None) -> str:
    """The lines of a chunk: each column's fields side by side, a comma between columns and
    ``line_ends`` (default newlines) after the last, without the fields' 0s."""
    rows = len(columns[0][0])
    chars: list[np.ndarray] = []
    comma = np.full((rows, 1), ord(","), np.uint8)
    for fields in columns:
        chars += fields
        chars.append(comma)
    chars[-1] = (np.full(rows, ord("\n"), np.uint8) if line_ends is None
                 else line_ends)[:, None]
    flat = np.hstack(chars).ravel()
    return flat[flat != 0].tobytes().decode("ascii")


def _write_steps_reference(out: Path, steps: list[StepRecord]) -> None:
    """The plain steps.csv / tenants.csv writer (``_write_steps`` writes the same, faster)."""
    with open(out / "steps.csv", "w", newline="") as f, \
            open(out / "tenants.csv", "w", newline="") as g:
        ws = csv.writer(f, lineterminator="\n")
        ws.writerow(STEP_COLUMNS)
        g.write(csv_fields(TENANT_COLUMNS) + "\n")
        for s in steps:
            ws.writerow([_fmt(s.time), _fmt(s.duration), s.num_seqs, s.num_prefill_tokens,
                         s.num_decode_tokens, s.num_running, s.num_waiting, f"{s.kv_usage:.6f}",
                         s.num_preempted, s.replica])
            for tenant in sorted(s.tenant_tokens):
                p, o = s.tenant_tokens[tenant]
                g.write(csv_fields([_fmt(s.time), tenant, p, o]) + "\n")


def _clean(value: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


def read_config(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
