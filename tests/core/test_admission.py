"""The scheduler's admission bounds: requests and prompt tokens waiting, never admitted."""

from __future__ import annotations

import pytest
from core_helpers import fake_execute, make_req, make_scheduler

from twinserve.core.errors import EngineOverloaded


def test_waiting_requests_bound_counts_only_requests_that_will_wait() -> None:
    s = make_scheduler(max_num_seqs=2, max_waiting_requests=3)
    for i in range(5):  # 2 free seats + 3 that will wait
        s.add_request(make_req(f"r{i}", 8))
    with pytest.raises(EngineOverloaded) as info:
        s.add_request(make_req("r5", 8))
    assert info.value.reason == "max_waiting_requests" and info.value.retry_after_s > 0
    assert "r5" not in s.requests and s.num_waiting == 5  # a refused request leaves nothing
    s.update_from_output(out := s.schedule(0.0), fake_execute(out), 0.0)  # two are admitted
    assert s.num_queued == 3 and s.free_seats() == 0
    with pytest.raises(EngineOverloaded):  # the same bound after the step: no seat is free
        s.add_request(make_req("r5", 8))
    s.abort_requests(["r4"], 0.0)  # aborted while waiting: its place is free again
    s.add_request(make_req("r5", 8))
    s.abort_requests(["r0"], 0.0)  # aborted while running: a seat is free
    s.add_request(make_req("r6", 8))
    with pytest.raises(EngineOverloaded):
        s.add_request(make_req("r7", 8))


def test_a_burst_gets_the_same_answer_whether_or_not_a_step_ran_in_between() -> None:
    def admitted(step_after: int | None) -> int:
        s = make_scheduler(max_num_seqs=4, max_waiting_requests=6)
        count = 0
        for i in range(20):
            if i == step_after:
                s.update_from_output(out := s.schedule(0.0), fake_execute(out), 0.0)
            try:
                s.add_request(make_req(f"r{i}", 8))
                count += 1
            except EngineOverloaded:
                pass
        return count
    assert admitted(None) == admitted(2) == admitted(8) == 10


def test_waiting_tokens_bound_and_admission_frees_the_tokens() -> None:
    s = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_waiting_tokens=20,
                       max_num_batched_tokens=64)
    s.add_request(make_req("a", 16))
    with pytest.raises(EngineOverloaded, match="max_waiting_tokens"):
        s.add_request(make_req("b", 8))  # 16 + 8 > 20
    s.add_request(make_req("c", 4))
    assert s.num_queued_tokens == 20
    s.update_from_output(out := s.schedule(0.0), fake_execute(out), 0.0)
    assert s.num_queued == 0 and s.num_queued_tokens == 0
