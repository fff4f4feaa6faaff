from twinserve.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def test_free_queue_is_fifo_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 4, 0]
    assert q.num_free == 4
    for b in list(q):
        q.remove(b)
    assert q.num_free == 0 and list(q) == []


def test_allocate_evicts_least_recently_freed_cached_block():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, 111)
    pool.cache(b, 222)
    pool.free([b, a, c])  # b freed first, so it is evicted first
    assert pool.num_free == 3
    (x,) = pool.allocate(1)
    assert x is b and x.block_hash is None and 222 not in pool.cached
    assert pool.lookup(111) is a and pool.num_evictions == 1


def test_touch_revives_a_free_cached_block_and_free_returns_it():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, 5)
    pool.free([a])
    assert pool.num_free == 2
    pool.touch([pool.lookup(5)])
    assert a.ref_cnt == 1 and pool.num_free == 1 and a not in list(pool.free_queue)
    pool.touch([a])
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free == 1
    pool.free([a])
    assert pool.num_free == 2


def test_first_writer_wins_and_reset_is_refused_while_in_use():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, 9)
    pool.cache(b, 9)
    assert pool.lookup(9) is a and b.block_hash is None
    assert pool.reset_prefix_cache() is False
    pool.free([a, b])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(9) is None and a.block_hash is None
    assert pool.usage == 0.0


def test_bulk_pop_and_extend_keep_queue_order_and_counts():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks[:4])
    taken = q.popleft_n(3)
    assert [b.block_id for b in taken] == [0, 1, 2]
    assert all(b.prev_free is None and b.next_free is None for b in taken)
    assert [b.block_id for b in q] == [3] and q.num_free == 1
    q.extend([blocks[5], blocks[1]])
    assert [b.block_id for b in q] == [3, 5, 1] and q.num_free == 3
    assert q.popleft_n(3) == [blocks[3], blocks[5], blocks[1]] and list(q) == []
    q.extend([])
    assert q.num_free == 0
    q.append(blocks[4])
    assert [b.block_id for b in q] == [4]
    try:
        q.popleft_n(2)
    except IndexError:
        pass
    else:
        raise AssertionError("popleft_n must refuse more blocks than are free")


def test_cache_all_registers_pairs_first_writer_wins():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_all([a, b], [10, 11])
    pool.cache_all([c], [10])
    assert pool.lookup(10) is a and pool.lookup(11) is b and c.block_hash is None
