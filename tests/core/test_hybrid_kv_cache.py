"""The hybrid KV cache (core, no torch): vLLM's grouping of mixed layers, one block table per
group over one pool, the sliding groups freeing what their window no longer sees while the full
group keeps everything, prefix-cache hits valid for every group, all-or-nothing allocation, and
the scheduler's invariants under random workloads."""

from __future__ import annotations

import pytest
from core_helpers import make_req, make_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinserve.core import ModelRunnerOutput
from twinserve.core.kv_cache_coordinator import HybridKVCacheManager, make_kv_cache_manager
from twinserve.core.kv_cache_groups import kv_cache_layout
from twinserve.core.kv_cache_manager import KVCacheManager, group_key


def gemma3_windows(num_layers: int, window: int, every: int = 6) -> list[int | None]:
    return [None if (i + 1) % every == 0 else window for i in range(num_layers)]


def test_layouts_follow_vllms_grouping() -> None:
    one = kv_cache_layout([None] * 4)
    assert one.group_windows == (None,) and one.slots_per_block == 4
    assert kv_cache_layout([8] * 3).group_windows == (8,)
    gemma2 = kv_cache_layout([8, None] * 3)
    assert gemma2.group_windows == (None, 8) and gemma2.slots_per_block == 3
    assert gemma2.group_layers == ((1, 3, 5), (0, 2, 4))
    g3 = kv_cache_layout(gemma3_windows(12, 16))  # 10 sliding + 2 full: group size 2
    assert g3.group_windows == (None,) + (16,) * 5 and g3.slots_per_block == 2
    assert g3.group_layers[0] == (5, 11) and g3.group_layers[1] == (0, 6)
    assert sorted(sum(g3.group_layers, ())) == list(range(12))
    assert g3.layer_group[5] == 0 and g3.layer_slot[11] == 1
    big = kv_cache_layout(gemma3_windows(62, 1024))  # Gemma 3 27B: 52 sliding + 10 full
    assert big.slots_per_block == 10 and big.num_groups == 7
    assert [len(g) for g in big.group_layers] == [10, 9, 9, 9, 9, 8, 8]
    assert kv_cache_layout([8] * 12 + [None] * 13).slots_per_block == 13  # within 1.5x: the max


def compute(kv: KVCacheManager, req, n: int, hits=None) -> None:
    assert kv.allocate_slots(req, n, hits) is not None
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)


def test_a_long_sequence_frees_sliding_blocks_and_keeps_full_ones() -> None:
    kv = HybridKVCacheManager(64, 4, group_windows=(None, 6, 6))
    assert kv.num_free_blocks == 63  # the null block
    req = make_req("a", 40, max_tokens=100)
    for _ in range(5):
        compute(kv, req, 8)
    req.append_output_token(9, 0.0)
    compute(kv, req, 1)  # position 40 sees 35..40: blocks 8.. only
    full, *sliding = (g.tables["a"] for g in kv.groups)
    assert full.num_dropped == 0 and len(full.blocks) == 11
    for table in sliding:
        assert len(table.blocks) == 11 and table.num_dropped == 8
        assert table.ids[:8] == [kv.null_block.block_id] * 8
    assert 63 - kv.num_free_blocks == 11 + 2 * 3
    table = kv.tables["a"]
    assert table is full and table.group_ids == (full.ids, sliding[0].ids, sliding[1].ids)
    kv.check_consistency()
    kv.free(req)
    kv.check_consistency()
    assert kv.num_free_blocks == 63


def test_allocation_is_all_or_nothing_across_groups() -> None:
    kv = HybridKVCacheManager(11, 4, group_windows=(None, 100))
    req = make_req("a", 20)
    assert kv.allocate_slots(req, 16) is not None  # 4 + 4 of 10
    req.num_computed_tokens = 16
    before = kv.num_free_blocks
    assert kv.allocate_slots(req, 8) is None  # full alone would fit (2), both need 4
    assert kv.num_free_blocks == before
    assert [len(g.tables["a"].blocks) for g in kv.groups] == [4, 4]
    kv.check_consistency()


def test_a_prefix_hit_needs_all_full_blocks_and_only_the_window_of_sliding_ones() -> None:
    kv = HybridKVCacheManager(64, 4, group_windows=(None, 5))  # window 5: 1 block before a hit
    shared = list(range(100, 124))
    first = make_req("a", 25, prefix=shared)
    compute(kv, first, 25)
    kv.free(first)
    second = make_req("b", 25, prefix=shared)
    hits, n = kv.get_computed_blocks(second)
    assert n == 24 and len(hits) == 12
    sliding_hits = hits[6:]
    assert sliding_hits[:5] == [kv.null_block] * 5 and sliding_hits[5] is not kv.null_block
    free_before = kv.num_free_blocks
    compute(kv, second, 1, hits)
    assert kv.num_free_blocks == free_before - 6 - 1 - 2  # 6 + 1 revived, 1 new in each group
    assert kv.groups[1].tables["b"].num_dropped == 5
    kv.check_consistency()


def test_a_hit_stops_where_a_sliding_group_lost_its_window() -> None:
    kv = HybridKVCacheManager(64, 4, group_windows=(None, 5))  # a hit needs 1 sliding block
    shared = list(range(100, 124))
    first = make_req("a", 25, prefix=shared)
    compute(kv, first, 25)
    kv.free(first)
    # the sliding group's block 5 (tokens 20..23) evicted, as a later allocation may do
    block = kv.pool.cached.pop(group_key(first.block_hashes[5], kv.groups[1].key_salt))
    block.block_hash = None
    hits, n = kv.get_computed_blocks(make_req("b", 25, prefix=shared))
    assert n == 20  # the full group holds 6 blocks; the sliding one can end its window at 5
    assert hits[:5] == [kv.pool.cached[h] for h in first.block_hashes[:5]]
    assert hits[5:9] == [kv.null_block] * 4 and hits[9] is not kv.null_block
    second = make_req("c", 25, prefix=shared)
    compute(kv, second, 5, kv.get_computed_blocks(second)[0])
    assert kv.groups[1].tables["c"].num_dropped == 4
    kv.check_consistency()


def test_the_groups_cache_apart_in_one_pool() -> None:
    kv = HybridKVCacheManager(32, 4, group_windows=(None, 8))
    req = make_req("a", 9)
    compute(kv, req, 9)
    full, sliding = (g.tables["a"] for g in kv.groups)
    assert {b.block_hash for b in full.blocks[:2]}.isdisjoint(
        b.block_hash for b in sliding.blocks[:2])
    assert len(kv.pool.cached) == 4


def test_fork_and_swap_move_every_group() -> None:
    kv = HybridKVCacheManager(32, 4, num_cpu_blocks=16, group_windows=(None, 4))
    parent = make_req("p", 10)
    compute(kv, parent, 8)
    compute(kv, parent, 2)  # from position 8 the window (4) no longer sees block 0
    child = make_req("p#1", 10)
    kv.fork(parent, child)
    assert kv.tables["p#1"].group_ids[1] == kv.groups[1].tables["p"].ids
    child.num_computed_tokens = 9
    assert kv.allocate_slots(child, 1) is not None  # copy-on-write in both groups
    assert len(kv.take_block_ops().copy) == 2
    kv.check_consistency()
    assert kv.swap_out(parent)
    ops = kv.take_block_ops()
    assert len(ops.swap_out) == 3 + 2  # full: 3 blocks; sliding: only the window's
    assert kv.can_swap_in(parent, 1)
    kv.swap_in(parent)
    kv.check_consistency()
    for r in (parent, child):
        kv.free(r)
    kv.check_consistency()
    assert kv.num_free_blocks == 31 and kv.host_pool.num_free == 16


def test_admission_counts_every_group() -> None:
    kv = HybridKVCacheManager(40, 4, group_windows=(None, 6, 6))
    assert kv.max_blocks_held(100, max_chunk=1) == 25 + 2 * 3
    s = make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=8, max_model_len=400,
                       kv_cache_group_windows=(None, 6, 6))
    with pytest.raises(ValueError, match="KV-cache blocks"):
        s.add_request(make_req("long", 140, max_tokens=10))  # 36 + 2 * 5 > 39
    s.add_request(make_req("ok", 80, max_tokens=10))  # 23 + 2 * 5 blocks


@pytest.mark.parametrize("windows", [(None,), (8, 8), (None, 8, 16), (4, 4, 4)])
def test_layouts_without_one_full_and_one_window_are_refused(windows) -> None:
    with pytest.raises(ValueError, match="hybrid KV cache"):
        HybridKVCacheManager(16, 4, group_windows=windows)


def test_one_group_is_the_plain_manager() -> None:
    kv = make_kv_cache_manager(16, 4, sliding_window=8, group_windows=(8,))
    assert type(kv) is KVCacheManager and kv.sliding_window == 8
    req = make_req("a", 5)
    compute(kv, req, 5)
    assert kv.tables["a"].group_ids == ()


op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30), st.integers(0, 3),
              st.integers(1, 2)),
    st.tuples(st.just("step"), st.integers(0, 9)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=40), window=st.integers(1, 12), sliding=st.integers(1, 3),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       chunked=st.booleans())
def test_scheduler_with_hybrid_groups_keeps_invariants(ops, window, sliding, mode, caching,
                                                        chunked) -> None:
    from twinserve.core import SamplingParams
    windows = (None,) + (window,) * sliding
    s = make_scheduler(num_blocks=40, block_size=4, max_num_seqs=5, max_num_batched_tokens=48,
                       max_model_len=48, preemption_mode=mode, num_cpu_blocks=16,
                       enable_prefix_caching=caching, enable_chunked_prefill=chunked,
                       kv_cache_group_windows=windows)
    shared = list(range(300, 316))
    added: list[str] = []
    now = 0.0
    for o in ops:
        if o[0] == "add":
            _, plen, max_tokens, prio, n = o
            req = make_req(f"r{len(added)}", plen, prefix=shared[:min(plen, 12)] if prio else None,
                           params=SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True),
                           arrival=now)
            try:
                s.add_request(req)
            except ValueError:
                continue  # a request that could never fit
            added.append(req.request_id)
        elif o[0] == "abort" and added:
            s.abort_requests([added[o[1] % len(added)]], now)
        else:
            for _ in range(o[1] + 1):
                _step(s, windows, now)
                now += 1.0
    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        _step(s, windows, now)
        now += 1.0
    assert not s.has_unfinished_requests()
    s.kv.check_consistency()
    assert s.kv.num_free_blocks == 39 and s.kv.host_pool.num_free == 16
    assert all(not g.tables for g in s.kv.groups)


def _step(s, windows, now: float) -> None:
    out = s.schedule(now)
    null = s.kv.null_block.block_id
    for sr in out.scheduled:  # each group's table holds a real block wherever its queries look
        assert len(sr.group_block_ids) == len(windows) and sr.group_block_ids[0] is sr.block_ids
        end = sr.start + sr.num_new_tokens
        for ids, window in zip(sr.group_block_ids, windows):
            first = 0 if window is None else max(0, sr.start - window + 1)
            assert len(ids) * 4 >= end
            assert null not in ids[first // 4:-(-end // 4)]
    s.kv.check_consistency()
    s.update_from_output(out, ModelRunnerOutput(
        {sr.request_id: [9] for sr in out.scheduled if sr.sample}), now + 0.5)


def test_a_twin_decode_run_counts_a_block_per_group() -> None:
    """core.decode_run plans runs of decode-only steps by the free blocks: with several groups
    a decode that starts a block takes one in each."""
    from core_helpers import step

    from twinserve.core.decode_run import plan_decode_run
    s = make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_model_len=200,
                       kv_cache_group_windows=(None, 100, 100))
    for i in range(2):
        s.add_request(make_req(f"r{i}", 8, max_tokens=40))
    for now in range(3):
        step(s, float(now))
    run = plan_decode_run(s, 7)
    assert run is not None and run.max_steps < 36  # 21 free blocks: 7 block starts, not 21
    run.apply([3.0 + i for i in range(run.max_steps)])
    s.kv.check_consistency()


@pytest.mark.parametrize("windows", [(None, 6), (None, 6, 6, 6), (None, None, 30)])
@pytest.mark.parametrize("chunk", [1, 16])
def test_the_configs_sequence_capacity_is_what_the_manager_admits(windows, chunk) -> None:
    """core.engine_config sizes max_model_len by sequence_kv_tokens: the longest sequence the
    manager's admission (max_blocks_held over every group) lets through."""
    from twinserve.core.engine_config import sequence_kv_tokens
    from twinserve.core.kv_cache_groups import KVCacheLayout
    layout = KVCacheLayout(windows, tuple((g,) for g in range(len(windows))), 1)
    for num_blocks in (12, 40, 101):
        kv = HybridKVCacheManager(num_blocks, 4, group_windows=windows)
        tokens = sequence_kv_tokens(layout, num_blocks, 4, chunk)
        assert kv.max_blocks_held(tokens, chunk) <= kv.num_usable_blocks
        assert kv.max_blocks_held(tokens + 4, chunk) > kv.num_usable_blocks
