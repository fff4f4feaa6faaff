import pytest
from core_helpers import make_req

from twinserve.core import SamplingParams
from twinserve.core.kv_cache_manager import KVCacheManager


def compute(kv, req, n, hits=None):
    assert kv.allocate_slots(req, n, hits) is not None
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_gpu_blocks=4, block_size=4)
    r1, r2 = make_req("a", 12), make_req("b", 8)
    compute(kv, r1, 12)
    assert kv.num_free_blocks == 1
    assert kv.allocate_slots(r2, 8) is None
    assert kv.num_free_blocks == 1 and kv.tables["b"].blocks == []
    kv.check_consistency()


def test_prefix_hit_reuses_blocks_and_recomputes_last_token():
    kv = KVCacheManager(num_gpu_blocks=16, block_size=4)
    shared = list(range(100, 108))
    r1 = make_req("a", 10, prefix=shared)
    compute(kv, r1, 10)
    r2 = make_req("b", 13, prefix=shared)
    hits, n = kv.get_computed_blocks(r2)
    assert n == 8 and [b.block_id for b in hits] == kv.block_ids(r1)[:2]
    compute(kv, r2, 5, hits)
    assert kv.block_ids(r2)[:2] == kv.block_ids(r1)[:2]
    assert all(b.ref_cnt == 2 for b in hits)
    # a prompt that is entirely cached still recomputes its last token
    r3 = make_req("c", 8, prefix=shared)
    hits3, n3 = kv.get_computed_blocks(r3)
    assert n3 == 4
    kv.check_consistency()


def test_cached_blocks_survive_free_until_evicted():
    kv = KVCacheManager(num_gpu_blocks=4, block_size=4)
    shared = list(range(50, 58))
    r1 = make_req("a", 9, prefix=shared)
    compute(kv, r1, 9)
    kv.free(r1)
    assert kv.num_free_blocks == 4
    _, n = kv.get_computed_blocks(make_req("b", 9, prefix=shared))
    assert n == 8
    # fill the cache with something else: the cached blocks get evicted
    r3 = make_req("c", 16)
    compute(kv, r3, 16)
    _, n = kv.get_computed_blocks(make_req("d", 9, prefix=shared))
    assert n == 0


def test_lora_adapter_separates_cache_entries():
    kv = KVCacheManager(num_gpu_blocks=16, block_size=4)
    shared = list(range(10, 18))
    compute(kv, make_req("a", 9, prefix=shared, lora="x"), 9)
    assert kv.get_computed_blocks(make_req("b", 9, prefix=shared, lora="y"))[1] == 0
    assert kv.get_computed_blocks(make_req("c", 9, prefix=shared, lora="x"))[1] == 8


def test_fork_shares_blocks_and_copies_on_write():
    kv = KVCacheManager(num_gpu_blocks=8, block_size=4)
    parent = make_req("p", 6, params=SamplingParams(n=2, max_tokens=3))
    compute(kv, parent, 6)
    child = make_req("p#1", 6)
    child.prompt_token_ids = parent.prompt_token_ids
    child.all_token_ids = list(parent.prompt_token_ids)
    kv.fork(parent, child)
    assert kv.block_ids(child) == kv.block_ids(parent)
    child.num_computed_tokens = 5  # recompute the last prompt token
    assert kv.allocate_slots(child, 1) is not None
    ops = kv.take_block_ops()
    assert ops.copy == [(kv.block_ids(parent)[1], kv.block_ids(child)[1])]
    assert kv.block_ids(child)[0] == kv.block_ids(parent)[0]
    assert kv.block_ids(child)[1] != kv.block_ids(parent)[1]
    kv.check_consistency()
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(num_gpu_blocks=4, block_size=4, num_cpu_blocks=3)
    r = make_req("a", 10)
    compute(kv, r, 10)
    device = list(kv.block_ids(r))
    assert kv.swap_out(r)
    ops = kv.take_block_ops()
    assert [d for d, _ in ops.swap_out] == device
    assert kv.num_free_blocks == 4 and kv.host_pool.num_free == 0
    assert kv.can_swap_in(r)
    kv.swap_in(r)
    ops = kv.take_block_ops()
    assert len(ops.swap_in) == 3 and kv.host_pool.num_free == 3
    assert kv.block_ids(r) == [d for _, d in ops.swap_in]
    kv.check_consistency()
    # no room on the host: refused, nothing changes
    big = KVCacheManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=1)
    r2 = make_req("b", 10)
    compute(big, r2, 10)
    assert big.swap_out(r2) is False and len(big.block_ids(r2)) == 3


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_gpu_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        KVCacheManager(num_gpu_blocks=0, block_size=4)
