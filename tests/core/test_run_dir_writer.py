"""The run folder's ITL column, each distinct gap formatted once, against the plain per-gap
format (``run_dir._request_row``'s), including the values ``np.unique`` treats specially."""

from __future__ import annotations

import math
import os
import random
from array import array

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
             (9.5, 0.25, 1, 2, 3, 4, 5, 2.5e6, 0, 0),
             # out-of-range ints in columns of ints only (the bounds checked on the array)
             (9.75, 0.25, 1, 2, 3, -4, 10**18, 0.5, 0, 0)]
    columns = [list(c) for c in zip(*rows)]
    want = "".join(map(run_dir._step_line, rows))
    assert run_dir._steps_text(columns) == want
    assert columns == [list(c) for c in zip(*rows)]  # the columns are left as they were
    assert run_dir._steps_text([[] for _ in range(10)]) == ""
    with_chunks = rows * (run_dir._CHUNK_ROWS // len(rows) + 2)
    assert run_dir._steps_text([list(c) for c in zip(*with_chunks)]) == \
        "".join(map(run_dir._step_line, with_chunks))


def _folder_bytes(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_steps_written_by_a_forked_child_are_the_same_bytes(tmp_path, monkeypatch) -> None:
    from twinserve.core.metrics import StepRecord
    rng = random.Random(5)
    steps = [StepRecord(i * 0.01, rng.uniform(1e-3, 0.1), 3, rng.randint(0, 99), 2, 3,
                        rng.randint(0, 9), rng.random(), 0,
                        tenant_tokens={"a": (rng.randint(0, 9), 1), "b": (0, 2)})
             for i in range(300)]
    records = [_record(i, [0.01, 0.02]) for i in range(20)]
    args = ({"backend": "sim"}, records, {"completed": 20}, steps)
    in_process = run_dir.write_run(tmp_path / "plain", *args)
    monkeypatch.setattr(run_dir, "_FORK_STEPS_AT", 1)
    forked = run_dir.write_run(tmp_path / "forked", *args)
    assert _folder_bytes(forked) == _folder_bytes(in_process)
    assert "steps.csv" in _folder_bytes(forked)

    parent, plain_write = os.getpid(), run_dir._write_steps

    def fails_in_the_child(out, rows) -> None:
        if os.getpid() != parent:
            raise OSError("disk full")
        plain_write(out, rows)
    monkeypatch.setattr(run_dir, "_write_steps", fails_in_the_child)
    rewritten = run_dir.write_run(tmp_path / "child-failed", *args)  # the parent writes them
    assert _folder_bytes(rewritten) == _folder_bytes(in_process)
