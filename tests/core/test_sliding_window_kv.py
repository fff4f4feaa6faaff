"""Sliding-window KV: blocks wholly outside the window are freed (their table slots point at the
null block), a long sequence's blocks stay bounded, and prefix caching, forks, swapping and the
scheduler's invariants hold with it."""

from __future__ import annotations

import pytest
from core_helpers import make_req, make_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinserve.core import ModelRunnerOutput, SamplingParams
from twinserve.core.kv_cache_manager import KVCacheManager


def compute(kv: KVCacheManager, req, n: int, hits=None) -> None:
    assert kv.allocate_slots(req, n, hits) is not None
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)


def live_positions(kv: KVCacheManager, req) -> set[int]:
    """Positions whose block is a real one (not the null block) in the request's table."""
    table = kv.tables[req.request_id]
    return {p for i, b in enumerate(table.blocks) if b is not kv.null_block
            for p in range(i * kv.block_size, (i + 1) * kv.block_size)}


def test_decoding_past_the_window_frees_blocks_and_keeps_the_window() -> None:
    kv = KVCacheManager(num_gpu_blocks=8, block_size=4, sliding_window=6)
    assert kv.num_free_blocks == 7  # one is the null block
    req = make_req("a", 5, max_tokens=100)
    compute(kv, req, 5)
    held = []
    for _ in range(60):  # 60 decodes through a 7-block pool: only possible if blocks are freed
        req.append_output_token(9, 0.0)
        assert kv.append_slot(req) is not None
        pos = req.num_computed_tokens
        assert set(range(max(0, pos - 5), pos + 1)) <= live_positions(kv, req)
        req.num_computed_tokens += 1
        kv.cache_full_blocks(req)
        held.append(7 - kv.num_free_blocks)
        kv.check_consistency()
    assert max(held) <= 3 and kv.tables["a"].num_dropped >= 13
    assert kv.tables["a"].ids[0] == kv.null_block.block_id
    kv.free(req)
    kv.check_consistency()
    assert kv.num_free_blocks == 7


def test_a_chunked_prefill_longer_than_the_pool_runs_within_the_window() -> None:
    kv = KVCacheManager(num_gpu_blocks=6, block_size=4, sliding_window=8)
    req = make_req("a", 40)
    for _ in range(5):  # 8-token chunks; without freeing, 40 tokens would need 10 blocks
        start = req.num_computed_tokens
        compute(kv, req, 8)
        assert set(range(max(0, start - 7), start + 8)) <= live_positions(kv, req)
    kv.check_consistency()


def test_without_a_window_nothing_is_freed_and_no_block_is_reserved() -> None:
    kv = KVCacheManager(num_gpu_blocks=8, block_size=4)
    assert kv.null_block is None and kv.num_free_blocks == 8
    req = make_req("a", 20)
    compute(kv, req, 20)
    assert kv.num_free_blocks == 3 and kv.tables["a"].num_dropped == 0


def test_freed_blocks_stay_in_the_prefix_cache_until_evicted() -> None:
    kv = KVCacheManager(num_gpu_blocks=16, block_size=4, sliding_window=4)
    shared = list(range(100, 116))
    first = make_req("a", 17, prefix=shared)
    for _ in range(17):
        compute(kv, first, 1)
    assert kv.tables["a"].num_dropped >= 3
    second = make_req("b", 17, prefix=shared)
    hits, n = kv.get_computed_blocks(second)
    assert n == 16  # the dropped blocks are still cache entries
    compute(kv, second, 1, hits)
    # the adopted hits outside the window are released again at once
    assert live_positions(kv, second) >= set(range(13, 17))
    assert kv.tables["b"].num_dropped >= 3
    kv.check_consistency()


def test_fork_and_swap_keep_the_dropped_prefix() -> None:
    kv = KVCacheManager(num_gpu_blocks=12, block_size=4, num_cpu_blocks=8, sliding_window=5)
    req = make_req("a", 14, params=SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    compute(kv, req, 14)
    compute(kv, req, 0)  # the next step's allocation frees what the window left
    dropped = kv.tables["a"].num_dropped
    assert dropped >= 2
    child = make_req("a#1", 14)
    child.num_computed_tokens = req.num_computed_tokens
    kv.fork(req, child)
    kv.check_consistency()
    assert kv.swap_out(child)
    assert len(kv.tables["a#1"].host_blocks) == len(kv.tables["a"].blocks) - dropped
    kv.check_consistency()
    assert kv.can_swap_in(child)
    kv.swap_in(child)
    assert kv.tables["a#1"].num_dropped == dropped
    assert len(kv.tables["a#1"].blocks) == len(kv.tables["a"].blocks)
    kv.check_consistency()
    kv.free(child)
    kv.free(req)
    kv.check_consistency()
    assert kv.num_free_blocks == 11


@pytest.mark.parametrize("window", [0, -3, True, 2.5])
def test_a_bad_window_is_refused(window) -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(num_gpu_blocks=8, block_size=4, sliding_window=window)


op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(0, 9)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=40), window=st.integers(1, 12),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans())
def test_scheduler_with_a_window_keeps_invariants(ops, window, mode, caching) -> None:
    s = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=5, max_num_batched_tokens=16,
                       max_model_len=72, preemption_mode=mode, num_cpu_blocks=10,
                       enable_prefix_caching=caching, sliding_window=window)
    shared = list(range(300, 316))
    added, now = 0, 0.0
    for o in ops:
        if o[0] == "add":
            _, plen, max_tokens, prio = o
            s.add_request(make_req(f"r{added}", plen, max_tokens=max_tokens,
                                   prefix=shared[:min(plen, 12)] if prio else None, arrival=now))
            added += 1
            continue
        for _ in range(o[1] + 1):
            _step(s, window, now)
            now += 1.0
    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        _step(s, window, now)
        now += 1.0
    assert not s.has_unfinished_requests()
    s.kv.check_consistency()
    assert s.kv.num_free_blocks == 23 and not s.kv.tables


def _step(s, window: int, now: float) -> None:
    out = s.schedule(now)
    for sr in out.scheduled:  # every key a query of this step sees has a real block
        needed = set(range(max(0, sr.start - window + 1), sr.start + sr.num_new_tokens))
        assert needed <= live_positions(s.kv, sr.request)
    s.kv.check_consistency()
    s.update_from_output(out, ModelRunnerOutput(
        {sr.request_id: [9] for sr in out.scheduled if sr.sample}), now + 0.5)


def test_hits_outside_the_window_are_not_revived() -> None:
    kv = KVCacheManager(num_gpu_blocks=16, block_size=4, sliding_window=4)
    shared = list(range(100, 116))
    first = make_req("a", 17, prefix=shared)
    compute(kv, first, 17)
    kv.free(first)
    free_before = kv.num_free_blocks
    second = make_req("b", 17, prefix=shared)
    hits, n = kv.get_computed_blocks(second)
    assert n == 16
    compute(kv, second, 1, hits)
    table = kv.tables["b"]
    assert table.num_dropped == 3 and table.blocks[3] is hits[3]  # position 16 sees 13..16
    assert all(b.ref_cnt == 0 for b in hits[:3])  # still cache entries, never revived
    assert kv.num_free_blocks == free_before - 2  # hit 3 revived, one new block
    kv.check_consistency()


def test_admission_counts_the_window_not_the_whole_sequence() -> None:
    kv = KVCacheManager(num_gpu_blocks=8, block_size=4, sliding_window=6)
    assert kv.num_usable_blocks == 7
    assert kv.max_blocks_held(1000, max_chunk=1) == 3  # ceil(6 / 4) + 1
    assert kv.max_blocks_held(1000, max_chunk=16) == 7  # ceil(21 / 4) + 1
    assert kv.max_blocks_held(5, max_chunk=16) == 2
    assert KVCacheManager(8, 4).max_blocks_held(1000, 1) == 250
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=8, max_model_len=400,
                       sliding_window=6)
    req = make_req("long", 300, max_tokens=50)
    s.add_request(req)  # 350 tokens through 7 usable blocks: only with the window
    for step in range(200):
        out = s.schedule(float(step))
        s.update_from_output(out, ModelRunnerOutput(
            {sr.request_id: [9] for sr in out.scheduled if sr.sample}), step + 0.5)
        s.kv.check_consistency()
        if not s.has_unfinished_requests():
            break
    assert req.num_output_tokens == 50 and s.kv.num_free_blocks == 7
