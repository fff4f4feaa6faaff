"""The host KV tier's scheduler side (core/kv_offload.py), driven by hand as a scheduler would."""

from __future__ import annotations

import pytest

from twinserve.core.kv_connector import KVConnectorOutput
from twinserve.core.kv_offload import (
    HostBlockLRU,
    OffloadingConnectorScheduler,
    num_host_blocks,
)
from twinserve.core.outputs import ScheduledRequest, SchedulerOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import make_request

BS = 4


def _step(*entries: tuple) -> SchedulerOutput:
    out = SchedulerOutput()
    for request, start, n, block_ids in entries:
        out.scheduled.append(ScheduledRequest(request, start, n, block_ids,
                                              start + n == request.num_tokens))
    return out


def _done(conn: OffloadingConnectorScheduler, recving: set[str] = frozenset()) -> None:
    conn.update_connector_output(KVConnectorOutput(set(), set(recving), set()))


def test_num_host_blocks_from_gib_and_layout():
    assert num_host_blocks(1.0, 1 << 20) == 1024
    assert num_host_blocks(0.5, 3 << 20) == 170
    for bad in (0, -1.0, True, "2"):
        with pytest.raises(ValueError, match="kv_offloading_size"):
            num_host_blocks(bad, 1024)
    with pytest.raises(ValueError, match="holds no KV block"):
        num_host_blocks(1e-9, 1 << 20)


def test_stores_ordered_for_the_full_blocks_each_step_completes():
    conn = OffloadingConnectorScheduler(BS, 8)
    req = make_request("a", list(range(10)))
    table = [7, 3, 5]
    meta = conn.build_connector_meta(_step((req, 0, 6, table)))  # tokens 0..5: block 0 full
    assert meta.stores == [(7, 0)] and meta.loads == {} and meta.cancelled == []
    _done(conn)
    meta = conn.build_connector_meta(_step((req, 6, 4, table)))  # to 10: block 1 full
    assert meta.stores == [(3, 1)]
    _done(conn)
    req.append_output_token(99, 0.0)
    meta = conn.build_connector_meta(_step((req, 10, 1, table)))  # 11 tokens: nothing new
    assert meta.stores == []
    assert conn.stats.num_blocks_stored == 2


def test_blocks_host_already_holds_are_not_stored_again():
    conn = OffloadingConnectorScheduler(BS, 8)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 1])  # same first two blocks
    assert conn.build_connector_meta(_step((a, 0, 9, [0, 1, 2]))).stores == [(0, 0), (1, 1)]
    _done(conn)
    meta = conn.build_connector_meta(_step((b, 0, 13, [4, 5, 6, 8])))
    assert meta.stores == [(6, 2)]  # only its third block is new to the host


def test_speculative_drafts_never_complete_a_stored_block():
    conn = OffloadingConnectorScheduler(BS, 8)
    req = make_request("a", [1, 2, 3])
    out = _step((req, 0, 3, [0]))
    assert conn.build_connector_meta(out).stores == []
    _done(conn)
    out = SchedulerOutput()
    out.scheduled.append(ScheduledRequest(req, 2, 3, [0, 1], True, spec_token_ids=[5, 6]))
    assert conn.build_connector_meta(out).stores == []  # 3 tokens certain: block 0 not full


def test_lru_bound_never_exceeded_and_oldest_evicted():
    conn = OffloadingConnectorScheduler(BS, 3)
    reqs = [make_request(f"r{i}", [i] * 8) for i in range(3)]  # two distinct blocks each
    for i, req in enumerate(reqs):
        conn.build_connector_meta(_step((req, 0, 8, [2 * i, 2 * i + 1])))
        _done(conn)
        assert len(conn.lru) <= 3
    assert conn.stats.num_blocks_stored == 6 and conn.stats.num_blocks_evicted == 3
    # r2's blocks are the newest two; r1's second block survived, its first was evicted
    assert conn.get_num_new_matched_tokens(make_request("x", [2] * 8 + [5]), 0) == (8, True)
    assert conn.get_num_new_matched_tokens(make_request("y", [0] * 8 + [5]), 0) == (0, False)
    conn.lru.check_consistency()


def test_lookup_past_device_hits_whole_blocks_last_token_recomputed():
    conn = OffloadingConnectorScheduler(BS, 8)
    first = make_request("a", list(range(12)))
    conn.build_connector_meta(_step((first, 0, 12, [0, 1, 2])))
    _done(conn)
    same = make_request("b", list(range(12)))  # 12 tokens: at most 11 hit -> 2 whole blocks
    assert conn.get_num_new_matched_tokens(same, 0) == (8, True)
    assert conn.get_num_new_matched_tokens(same, 4) == (4, True)  # past one device block
    assert conn.get_num_new_matched_tokens(same, 8) == (0, False)
    longer = make_request("c", [*range(12), 50, 51])
    assert conn.get_num_new_matched_tokens(longer, 4) == (8, True)
    skip = make_request("d", list(range(12)), sampling_params=SamplingParams(prompt_logprobs=1))
    assert conn.get_num_new_matched_tokens(skip, 0) == (0, False)


def test_matched_blocks_load_into_the_new_blocks_and_stay_pinned_until_reported():
    conn = OffloadingConnectorScheduler(BS, 2)
    a = make_request("a", list(range(9)))
    conn.build_connector_meta(_step((a, 0, 9, [0, 1, 2])))
    _done(conn)
    b = make_request("b", [*range(8), 40, 41])
    assert conn.get_num_new_matched_tokens(b, 4) == (4, True)
    conn.update_state_after_alloc(b, [0, 5, 6], 4)  # block 0 a device hit, 5 and 6 new
    meta = conn.build_connector_meta(SchedulerOutput())
    assert meta.loads == {"b": [(1, 5)]}
    assert conn.stats.external_prefix_cache_hits == 4
    assert conn.stats.external_prefix_cache_queries == 10
    # host full (2 blocks), slot 1 pinned by the load: a new block can only evict slot 0
    c = make_request("c", [9] * 4)
    assert conn.build_connector_meta(_step((c, 0, 4, [3]))).stores == [(3, 0)]
    d = make_request("d", [8] * 4)
    # every slot pinned now (the load, c's store): d's store waits for the next step
    assert conn.build_connector_meta(_step((d, 0, 4, [4]))).stores == []
    _done(conn, {"b"})
    assert conn.lru.num_pinned == 0
    assert conn.build_connector_meta(_step((d, 0, 4, [4]))).stores == [(4, 1)]


def test_abort_cancels_a_load_in_flight_and_unpins():
    conn = OffloadingConnectorScheduler(BS, 4)
    a = make_request("a", list(range(9)))
    conn.build_connector_meta(_step((a, 0, 9, [0, 1, 2])))
    _done(conn)
    b = make_request("b", list(range(9)))
    assert conn.get_num_new_matched_tokens(b, 0) == (8, True)
    conn.update_state_after_alloc(b, [3, 4, 5], 8)
    assert conn.build_connector_meta(SchedulerOutput()).loads == {"b": [(0, 3), (1, 4)]}
    conn.request_aborted("b")
    assert conn.lru.num_pinned == 0
    assert conn.build_connector_meta(SchedulerOutput()).cancelled == ["b"]
    _done(conn, {"b"})  # a late report of the cancelled load changes nothing
    assert conn.lru.num_pinned == 0
    # aborted before its load was sent: the load is dropped, nothing to cancel
    c = make_request("c", list(range(9)))
    conn.get_num_new_matched_tokens(c, 0)
    conn.update_state_after_alloc(c, [6, 7, 8], 8)
    conn.request_finished(c, [6, 7, 8])
    meta = conn.build_connector_meta(SchedulerOutput())
    assert meta.loads == {} and meta.cancelled == [] and conn.lru.num_pinned == 0


def test_a_query_counts_once_per_admission():
    conn = OffloadingConnectorScheduler(BS, 4)
    a = make_request("a", list(range(6)))
    for _ in range(3):  # admission retried (no blocks): one query
        conn.get_num_new_matched_tokens(a, 0)
    conn.build_connector_meta(_step((a, 0, 6, [0, 1])))
    assert (conn.stats.external_prefix_cache_queries, conn.stats.external_prefix_cache_hits) == (6, 0)


def test_bad_alloc_report_names_the_tokens():
    conn = OffloadingConnectorScheduler(BS, 4)
    with pytest.raises(ValueError, match="num_external_tokens"):
        conn.update_state_after_alloc(make_request("a", [1] * 9), [0, 1, 2], 4)


def test_host_lru_validation_and_pins():
    with pytest.raises(ValueError, match="num_host_blocks"):
        HostBlockLRU(0)
    lru = HostBlockLRU(1)
    slot, evicted = lru.insert(11)
    assert (slot, evicted) == (0, None)
    lru.pin(slot)
    lru.pin(slot)
    assert lru.insert(12) is None
    lru.unpin(slot)
    assert lru.insert(12) is None  # still pinned once
    lru.unpin(slot)
    assert lru.insert(12) == (0, 11) and lru.get(11) is None and lru.get(12) == 0
    lru.check_consistency()
