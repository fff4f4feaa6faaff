"""The scheduler's admission bounds: requests and prompt tokens waiting, never admitted."""

from __future__ import annotations

import pytest
from core_helpers import fake_execute, make_req, make_scheduler

from twinserve.core.errors import EngineOverloaded


def test_waiting_requests_bound_counts_only_requests_never_admitted() -> None:
    s = make_scheduler(max_num_seqs=2, max_waiting_requests=3)
    for i in range(3):
        s.add_request(make_req(f"r{i}", 8))
    with pytest.raises(EngineOverloaded) as info:
        s.add_request(make_req("r3", 8))
    assert info.value.reason == "max_waiting_requests" and info.value.retry_after_s > 0
    assert "r3" not in s.requests and s.num_waiting == 3  # a refused request leaves nothing
    s.update_from_output(out := s.schedule(0.0), fake_execute(out), 0.0)  # two are admitted
    assert s.num_queued == 1
    s.add_request(make_req("r3", 8))
    s.add_request(make_req("r4", 8))
    s.abort_requests(["r4"], 0.0)  # aborted while waiting: its place is free again
    assert s.num_queued == 2
    s.add_request(make_req("r5", 8))
    with pytest.raises(EngineOverloaded):
        s.add_request(make_req("r6", 8))


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
