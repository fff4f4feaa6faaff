"""The run folder's ITL column, each distinct gap formatted once, against the plain per-gap
format (``run_dir._request_row``'s), including the values ``np.unique`` treats specially."""

from __future__ import annotations

import csv
import io
import math
import random
from array import array

import numpy as np
import pytest

from twinserve.core import run_dir
from twinserve.core.metrics import RequestRecord


def _record(i: int, itls: list[float]) -> RequestRecord:
    return RequestRecord(f"r{i}", 0.0, 0.1, 0.2, 1.0, 10, len(itls) + 1, itls=array("d", itls))


@pytest.mark.parametrize("extra", [[], [0.0, -0.0], [math.nan, math.inf, -1.5e-7, 0.0]],
                         ids=["gaps", "signed-zeros", "nan-inf-negative"])
def test_itl_texts_equal_the_plain_format(extra: list[float]) -> None:
    rng = random.Random(3)
    steps = [rng.expovariate(40) for _ in range(300)]  # gaps shared between requests
    records = [_record(i, [rng.choice(steps) for _ in range(rng.randint(0, 60))] + extra)
               for i in range(50)]
    records.append(_record(50, []))
    want = [" ".join(f"{g * 1e3:.6g}" for g in r.itls) for r in records]
    assert run_dir._itl_texts(records) == want
    assert run_dir._itl_texts([_record(0, [])]) == [""]
    records[7].itls = list(records[7].itls)  # a record built with a plain list of gaps
    assert run_dir._itl_texts(records) == want


def test_steps_text_equals_the_plain_lines() -> None:
    rng = random.Random(8)
    t, rows = 0, []
    for _ in range(5000):
        d = rng.choice([rng.expovariate(60), rng.uniform(1e-4, 2e-4), 0.5, 12.000000000500001,
                        2.5e-10, 3.0])
        kv = rng.choice([rng.random(), 0.0, 1.0, 0.1234565, 0.0000005])
        rows.append((t, d, rng.randint(0, 300), rng.randint(0, 9000), rng.randint(0, 300),
                     rng.randint(0, 300), rng.randint(0, 5000), kv, rng.randint(0, 3),
                     rng.randint(0, 2)))
        t += d
    # a tie of "%.9f" (0.5 ulp from the float product), out-of-range and oddly typed values
    rows += [(0.0000625, 1.0000000005, 1, 2, 3, 4, 5, 0.0000005, 0, 0),
             (1e6 + 0.25, 0.1, 1, 2, 3, 4, 5, 0.5, 0, 0),
             (7.5, math.nan, True, 2, 3, 4, 5, -0.0, 0, 0),
             (7.5, 0.25, -1, 2, 3, 4, 5, 0.5, 10**19, 0),
             (8, 0.25, 1, 2, 3, 4, 5, 1, 0, 0),
             (2**60 + 1, 0.25, 1, 2, 3, 4, 5, 0.5, 0, 0),  # ints among a float column's floats
             (9, 0.25, 1, 2, 3, 4, 5, 0.5, 0, 0),
             (9.5, 0.25, 1, 2, 3, 4, 5, 2.5e6, 0, 0),
             # out-of-range ints in columns of ints only (the bounds checked on the array)
             (9.75, 0.25, 1, 2, 3, -4, 10**18, 0.5, 0, 0)]
    columns = [list(c) for c in zip(*rows)]
    want = "".join(map(run_dir._step_line, rows))
    assert run_dir._steps_text(columns) == want
    assert columns == [list(c) for c in zip(*rows)]  # the columns are left as they were
    assert run_dir._steps_text([[] for _ in range(10)]) == ""
    huge = [*rows, (10**400, 0.25, 1, 2, 3, 4, 5, 0.5, 0, 0)]  # no float holds it: as the
    for write in (lambda: "".join(map(run_dir._step_line, huge)),  # plain format, refused
                  lambda: run_dir._steps_text([list(c) for c in zip(*huge)])):
        with pytest.raises(OverflowError):
            write()
    with_chunks = rows * (run_dir._CHUNK_ROWS // len(rows) + 2)
    assert run_dir._steps_text([list(c) for c in zip(*with_chunks)]) == \
        "".join(map(run_dir._step_line, with_chunks))


def _plain_itls(records: list[RequestRecord]) -> list[str]:
    return [" ".join(f"{g * 1e3:.6g}" for g in r.itls) for r in records]


def _decoding(i: int, times: list[float], first: int, n: int) -> RequestRecord:
    """A request whose first token came at step ``first``'s start and which then decoded in
    the ``n`` steps after, as on a busy engine: its gaps are those steps' time differences."""
    ends = times[first:first + n + 1]
    return RequestRecord(f"r{i}", 0.0, 0.0, ends[0], ends[-1], 10, n + 1,
                         itls=array("d", [b - a for a, b in zip(ends, ends[1:])]))


def test_itl_texts_cut_from_the_step_times_equal_the_plain_format(monkeypatch) -> None:
    rng = random.Random(11)
    times = [0]  # (an int first start, as SimPy's clock begins)
    for _ in range(400):
        times.append(times[-1] + rng.choice([rng.expovariate(50), 0.0125, 2e-7]))
    records = []
    for i in range(60):
        first = rng.randrange(len(times) - 1)
        records.append(_decoding(i, times, first, rng.randint(0, len(times) - 1 - first)))
    records[3].itls[-1] += 1e-12  # its last gap is not a step's (an idle engine, a preemption)
    records[4].itls = list(records[4].itls)
    records[5].first_token_time = math.nan
    records.append(_record(60, [0.25, -0.0, math.nan]))  # not the steps' gaps at all
    want = _plain_itls(records)
    assert run_dir._itl_texts(records, times) == want
    lengths = [len(r.itls) for r in records]
    for per_check in (1, 7, 2048):  # (records checked together)
        monkeypatch.setattr(run_dir, "_RECORDS_PER_CHECK", per_check)
        text, spans = run_dir._step_gap_spans(records, lengths, times)
        assert sorted(set(range(len(records))) - set(spans)) == \
            sorted([3, 5, 60] + [i for i, n in enumerate(lengths) if not n])  # the others: cut
        assert all(text[a:b] == want[i] for i, (a, b) in spans.items())
        assert run_dir._itl_texts(records, times) == want
    # steps of no duration (two steps starting at once: which is a record's?), and times that
    # are no engine's (unsorted, not numbers, too few)
    for odd in ([*times[:50], *times[49:]], times[::-1], [*times[:5], None, *times[6:]],
                times[:1], []):
        assert run_dir._itl_texts(records, odd) == want


def test_steps_written_beside_the_requests_are_the_reference_bytes(tmp_path) -> None:
    from twinserve.core.metrics import StepRecord
    rng = random.Random(5)
    steps = [StepRecord(i * 0.01, rng.uniform(1e-3, 0.1), 3, rng.randint(0, 99), 2, 3,
                        rng.randint(0, 9), rng.random(), 0,
                        tenant_tokens={"a": (rng.randint(0, 9), 1), "b": (0, 2)})
             for i in range(300)]
    times = [s.time for s in steps]
    records = [_decoding(i, times, 7 * i, 5) for i in range(20)] + [_record(20, [0.01, 0.02])]
    out = run_dir.write_run(tmp_path / "run", {"backend": "sim"}, records, {"completed": 21},
                            steps)
    run_dir._write_steps_reference(tmp_path, steps)
    for name in ("steps.csv", "tenants.csv"):
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name
    rows = (out / "requests.csv").read_text().splitlines()[1:]
    assert [row.split(",")[19] for row in rows] == _plain_itls(records)


def test_request_rows_equal_csv_writers_plain_rows() -> None:
    rng = random.Random(4)
    records = []
    for i in range(400):
        arrival = rng.uniform(0, 3600)
        first = arrival + rng.choice([rng.expovariate(5), 0.0, 2e-5])
        records.append(RequestRecord(
            f"req-{i}", arrival, first - rng.choice([0.0, 0.01]), first,
            first + rng.choice([rng.expovariate(0.1), 0.0]), rng.randint(1, 4000),
            rng.choice([0, 1, 2, rng.randint(3, 900)]), rng.randint(0, 4000), rng.randint(0, 3),
            tenant=rng.choice(["default", "a", "b"]), priority=rng.randint(-2, 2),
            itls=array("d", [rng.expovariate(40) for _ in range(rng.randint(0, 5))])))
    failed = RequestRecord("failed", 5.0, math.nan, math.nan, math.nan, 7, 0, success=False,
                           finish_reason="", error="the prompt is too long: 9 > 8")
    odd = [failed, RequestRecord('quote"d', 1.0, 1.5, 2.0, 3.0, 5, 3, tenant="a, b"),
           RequestRecord("ints", 0, 1, 2, 3, 5, 3, priority=True),
           RequestRecord("far", 2e6, 2e6 + 1, 2e6 + 2, 2e6 + 3, 5, 3, lora=None),  # type: ignore
           RequestRecord(7, 1e-6, 1e-5, 1e-3, 0.5, 5, 3, success=2)]  # type: ignore
    for k, record in enumerate(odd):
        records.insert(37 * k, record)
    for fleet in (False, True):  # (a fleet's rows end with the replica's index)
        for i, record in enumerate(records):
            record.replica = i % 3 if fleet else 0
        want = io.StringIO(newline="")
        csv.writer(want, lineterminator="\n").writerows(run_dir._request_row(r, fleet=fleet)
                                                        for r in records)
        got = io.StringIO(newline="")
        run_dir._write_requests(got, records, fleet=fleet)
        assert got.getvalue() == want.getvalue()
    assert want.getvalue().splitlines()[2].endswith(",2")
    heads = run_dir._row_heads(records)
    assert [i for i, head in enumerate(heads) if head is None] == [37, 74, 111, 148]


def test_six_significant_digits_in_numpy_equal_the_format() -> None:
    rng = random.Random(6)
    values = [10 ** rng.uniform(-6, 7) for _ in range(20000)]
    values += [rng.expovariate(100) * 1e3 for _ in range(5000)]  # step gaps in ms
    for p in range(-6, 8):  # around powers of ten, and values rounding up to the next one
        b = 10.0 ** p
        values += [b, math.nextafter(b, 0), math.nextafter(b, math.inf), b * 0.9999995,
                   b * 0.99999949, b * 0.99999951, 9.999995 * b, 9.99999501 * b]
    for d in range(100000, 1000000, 77777):  # ties of the sixth digit, and either side
        for k in range(10):
            v = (d + 0.5) / 10 ** k
            values += [v, math.nextafter(v, 0), math.nextafter(v, math.inf)]
    values += [0.0, -0.0, -1.5, math.nan, math.inf, -math.inf, 5e-324, 999999.0, 999999.5, 1e300]
    got = run_dir._g6_texts(np.array(values)).tolist()
    assert got == [f"{v:.6g}" for v in values]


def test_fields_with_line_breaks_are_quoted_and_read_back() -> None:
    """A request id, tenant or error holding a newline or a carriage return (an error message
    may span lines) is quoted, so the file reads back with every row and value intact."""
    records = [RequestRecord("plain", 0.0, 0.1, 0.2, 1.0, 10, 3, itls=array("d", [0.1, 0.2])),
               RequestRecord("two\nlines", 0.0, 0.1, 0.2, 1.0, 10, 3, tenant="t\rx"),
               RequestRecord("failed", 1.0, math.nan, math.nan, math.nan, 7, 0, success=False,
                             finish_reason="", error="line one\r\nline two, \"quoted\"")]
    out = io.StringIO(newline="")
    run_dir._write_requests(out, records)
    rows = list(csv.reader(io.StringIO(out.getvalue(), newline="")))
    assert len(rows) == len(records)
    assert [(row[0], row[1], row[14]) for row in rows] == [
        (r.request_id, r.tenant, r.error or "") for r in records]
    assert rows[0][:14] == [str(v) for v in run_dir._request_row(records[0])][:14]


def test_tenant_names_with_line_breaks_are_quoted_in_tenants_csv(tmp_path) -> None:
    """tenants.csv quotes a tenant holding a carriage return or newline, both writers alike, so
    every row reads back whole."""
    from twinserve.core.metrics import StepRecord
    tenants = {"t\rx": (3, 1), "a\nb": (0, 2), "plain": (1, 1)}
    steps = [StepRecord(i * 0.01, 0.01, 3, 4, 2, 3, 0, 0.5, 0, tenant_tokens=tenants)
             for i in range(3)]
    run_dir._write_steps(tmp_path, steps)
    fast = (tmp_path / "tenants.csv").read_bytes()
    run_dir._write_steps_reference(tmp_path, steps)
    assert fast == (tmp_path / "tenants.csv").read_bytes()
    with open(tmp_path / "tenants.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert len(rows) == 1 + 3 * len(tenants)
    assert [row[1] for row in rows[1:4]] == sorted(tenants)
