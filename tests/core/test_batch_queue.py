"""The batch queue's scheduler side: requests in flight are neither scheduled again nor
preempted, and come back when their batch is popped; aborts in flight end cleanly."""

from __future__ import annotations

import pytest
from core_helpers import fake_execute, make_req, make_scheduler

from twinserve.core.batch_queue import BatchQueue


def _ids(out) -> list[str]:
    return [sr.request_id for sr in out.scheduled]


def test_requests_in_flight_are_skipped_until_their_batch_returns() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    queue: BatchQueue[None] = BatchQueue(s, 2)
    for rid in ("a", "b"):
        s.add_request(make_req(rid, 4, max_tokens=3))
    first = s.schedule(0.0)
    assert _ids(first) == ["a", "b"]
    queue.push(first, None, 0.0)
    assert s.schedule(0.1).scheduled == []  # both in flight
    s.add_request(make_req("c", 4, max_tokens=3))
    second = s.schedule(0.2)
    assert _ids(second) == ["c"]  # the newcomer fills the second batch alone
    queue.push(second, None, 0.2)
    assert queue.full and queue.max_in_flight == 2 and s.in_flight == {"a", "b", "c"}
    batch = queue.pop()
    s.update_from_output(batch.out, fake_execute(batch.out), 0.3)
    assert s.in_flight == {"c"}
    third = s.schedule(0.4)
    assert _ids(third) == ["a", "b"] and all(sr.num_new_tokens == 1 for sr in third.scheduled)


def test_a_request_already_in_flight_cannot_be_pushed_twice() -> None:
    s = make_scheduler()
    queue: BatchQueue[None] = BatchQueue(s, 2)
    s.add_request(make_req("a", 4))
    out = s.schedule(0.0)
    queue.push(out, None, 0.0)
    with pytest.raises(RuntimeError, match="'a' is already in a batch in flight"):
        queue.push(out, None, 0.0)
    with pytest.raises(ValueError, match="depth"):
        BatchQueue(s, 0)


def test_victims_are_never_in_flight() -> None:
    # 6 blocks of 4: three 8-token prompts take 2 each; each decode then needs a third block
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    for i in range(3):
        s.add_request(make_req(f"r{i}", 8, max_tokens=9))
    out = s.schedule(0.0)
    s.update_from_output(out, fake_execute(out), 0.1)
    s.in_flight.add("r2")  # FCFS's victim (the latest admitted) is in the pipeline
    out = s.schedule(1.0)
    assert out.preempted_request_ids == ["r1"] and _ids(out) == ["r0"]
    assert [r.request_id for r in s.running] == ["r0", "r2"]
    s.in_flight.clear()  # without a batch in flight FCFS takes r2 as before
    assert s._victims(s.running) is s.running


def test_an_abort_in_flight_frees_blocks_and_its_result_is_skipped() -> None:
    s = make_scheduler(num_blocks=8)
    queue: BatchQueue[None] = BatchQueue(s, 2)
    for rid in ("a", "b"):
        s.add_request(make_req(rid, 6, max_tokens=2))
    out = s.schedule(0.0)
    queue.push(out, None, 0.0)
    s.abort_requests(["a"], 0.1)
    assert "a" not in s.kv.tables
    batch = queue.pop()
    outs = s.update_from_output(batch.out, fake_execute(batch.out), 0.2)
    assert [o.request_id for o in outs] == ["b"] and not s.in_flight
    while s.has_unfinished_requests():
        out = s.schedule(1.0)
        s.update_from_output(out, fake_execute(out), 1.1)
    assert s.kv.num_free_blocks == 8
    s.kv.check_consistency()


def test_balance_spreads_the_running_requests_over_the_batches() -> None:
    s = make_scheduler(max_num_batched_tokens=64)
    queue: BatchQueue[None] = BatchQueue(s, 2, balance=True)
    for i in range(5):
        s.add_request(make_req(f"r{i}", 4, max_tokens=8))
    out = queue.schedule(0.0)  # all waiting: admitted together
    assert len(out.scheduled) == 5
    s.update_from_output(out, fake_execute(out), 0.1)
    first = queue.schedule(1.0)
    assert _ids(first) == ["r0", "r1", "r2"] and not s.in_flight  # ceil(5 / 2), nothing held
    queue.push(first, None, 1.0)
    second = queue.schedule(1.1)
    assert _ids(second) == ["r3", "r4"]
    queue.push(second, None, 1.1)
    batch = queue.pop()
    s.update_from_output(batch.out, fake_execute(batch.out), 1.2)
    assert _ids(queue.schedule(1.3)) == ["r0", "r1", "r2"]  # one slot left: all that are free


def test_without_balance_requests_scheduled_together_stay_together() -> None:
    s = make_scheduler(max_num_batched_tokens=64)
    queue: BatchQueue[None] = BatchQueue(s, 2)
    for i in range(3):
        s.add_request(make_req(f"r{i}", 4, max_tokens=8))
    out = queue.schedule(0.0)
    s.update_from_output(out, fake_execute(out), 0.1)
    first = queue.schedule(1.0)
    queue.push(first, None, 1.0)
    assert len(first.scheduled) == 3 and queue.schedule(1.1).scheduled == []
