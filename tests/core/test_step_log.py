"""``StepLog`` keeps its columns as compact arrays; a value an array cannot hold as given (an int
time, a bool or out-of-range count, anything else) reads back as given, sorts with its row and
is written as the plain writer writes it."""

from __future__ import annotations

import dataclasses
import math
import random
from types import SimpleNamespace

import numpy as np

from twinserve.core import run_dir
from twinserve.core.metrics import StepLog, StepRecord


def _odd_records() -> list[StepRecord]:
    rng = random.Random(9)
    records = [StepRecord(rng.uniform(0, 50), rng.uniform(1e-3, 0.1), rng.randint(1, 64),
                          rng.randint(0, 4000), rng.randint(0, 64), rng.randint(1, 64),
                          rng.randint(0, 9), rng.random(), rng.randint(0, 2), rng.randint(0, 2),
                          {"a": (1, 2)} if rng.random() < 0.3 else {})
                   for _ in range(300)]
    odd = [dict(time=0), dict(time=7, tenant_tokens={"b": (3, 0)}), dict(num_seqs=True),
           dict(num_prefill_tokens=10**20), dict(num_waiting=-3), dict(kv_usage=1),
           dict(duration=np.float64(0.5)), dict(replica=2.5), dict(time=math.nan),
           dict(num_running=2**40)]  # (past 32 bits)
    for k, change in enumerate(odd):
        records[31 * k] = dataclasses.replace(records[31 * k], **change)
    for k in range(5):  # ties of time, ordered by replica (the float one among them)
        records[200 + k] = dataclasses.replace(records[200 + k], time=records[186].time,
                                               replica=3 - k)
    return records


def _astuples(records) -> list[str]:  # (repr: nan == nan, and each value's type)
    return [repr(dataclasses.astuple(r)) for r in records]


def test_odd_values_read_back_as_given_and_sort_with_their_rows() -> None:
    records = _odd_records()
    log = StepLog(records)
    assert _astuples(log) == _astuples(records)
    assert _astuples([log[i] for i in range(len(log))]) == _astuples(records)
    assert repr(log.column("time")) == repr([r.time for r in records])
    assert repr(log.raw()[0]) == repr([dataclasses.astuple(r)[:10] for r in records])
    assert len(log.odd()) == 8  # (a negative count and a nan time are what arrays hold)
    log.sort_by_time()
    # by time, then replica; a nan time last, as numpy sorts
    timed = [i for i, r in enumerate(records) if not math.isnan(r.time)]
    order = sorted(timed, key=lambda i: (records[i].time, records[i].replica))
    order += [i for i, r in enumerate(records) if math.isnan(r.time)]
    assert _astuples(log) == _astuples([records[i] for i in order])


def test_a_step_logs_odd_values_are_written_as_the_plain_writer_writes_them(tmp_path) -> None:
    records = [r for r in _odd_records() if not math.isnan(r.time)]
    records = [dataclasses.replace(r, num_prefill_tokens=0) if r.num_prefill_tokens > 10**19
               else r for r in records]  # (a count past 64 bits: in the plain writer's text)
    records.append(dataclasses.replace(records[0], num_prefill_tokens=10**20))
    run_dir._write_steps(tmp_path / "", StepLog(records))
    (tmp_path / "ref").mkdir()
    run_dir._write_steps_reference(tmp_path / "ref", records)
    for name in ("steps.csv", "tenants.csv"):
        assert (tmp_path / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name


def _scheduler(num_blocks: int, free: int, running: int, waiting: int) -> SimpleNamespace:
    pool = SimpleNamespace(blocks=[None] * num_blocks, free_queue=SimpleNamespace(num_free=free))
    return SimpleNamespace(kv=SimpleNamespace(pool=pool), running=[None] * running,
                           policy=[None] * waiting)


def test_a_decode_runs_rows_equal_the_rows_appended_one_by_one() -> None:
    requests = [SimpleNamespace(tenant=t) for t in ("a", "b", "a")]
    for start, ends in ((0.5, [0.75, 1.0, 1.5]), (0, [0.25, 0.5]), (0.5, [1, 1.25])):
        log, plain = StepLog(), StepLog()
        log.record_decode_run(requests, _scheduler(100, 0, 3, 0), start, ends, [40, 39, 30][:len(ends)],
                              4, replica=1, num_finished=1)
        starts = [start, *ends[:-1]]
        for j, (a, b) in enumerate(zip(starts, ends)):
            last = j == len(ends) - 1
            plain.append(StepRecord(a, b - a, 3, 0, 3, 2 if last else 3, 4 if last else 0,
                                    1.0 - [40, 39, 30][j] / 100, 0, 1, {"a": (0, 2), "b": (0, 1)}))
        assert _astuples(log) == _astuples(plain)
        assert log.odd() == plain.odd()


def test_taken_steps_leave_the_log_empty_and_recording() -> None:
    """``RunRecorder.take_steps`` (a replica's rows for its front): each row once, odd values
    and tenant tokens with it, and the same log, emptied, takes the next rows (a driver's
    ``completer`` holds its bound ``record_step``)."""
    from twinserve.core.step_driver import RunRecorder
    records = _odd_records()
    recorder = RunRecorder()
    keep = recorder.steps
    append = keep.append  # (as a completer holds it)
    for r in records[:150]:
        append(r)
    assert _astuples(recorder.take_steps()) == _astuples(records[:150])
    assert recorder.steps is keep and len(keep) == 0 and keep.odd() == {} \
        and keep.tenant_tokens() == {}
    for r in records[150:]:
        append(r)
    assert _astuples(recorder.take_steps()) == _astuples(records[150:])
    assert recorder.take_steps() == []
