import random

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


def test_removed_blocks_are_skipped_when_popped_and_refreed_ones_keep_their_new_place():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks[:5])
    q.remove(blocks[1])
    q.remove(blocks[3])
    q.append(blocks[1])  # freed again: its old entry stays stale, it now sits at the tail
    q.remove(blocks[1])
    q.append(blocks[1])
    q.append(blocks[5])
    assert [b.block_id for b in q] == [0, 2, 4, 1, 5] and q.num_free == 5
    assert q.popleft_n(2) == [blocks[0], blocks[2]]
    assert q.popleft() is blocks[4]
    assert [b.block_id for b in q] == [1, 5] and q.num_free == 2
    assert q.popleft_n(2) == [blocks[1], blocks[5]] and list(q) == [] and q.num_free == 0
    q.extend([blocks[3], blocks[0]])
    assert q.popleft_n(2) == [blocks[3], blocks[0]]


def test_free_queue_order_survives_compaction_and_stale_sweeps():
    """Random pops, removals, revive-then-free cycles (a prefix hit whose request ends) and frees
    against a plain list in LRU order; enough of each to compact the head and sweep stale entries."""
    rng = random.Random(0)
    blocks = [KVCacheBlock(i) for i in range(300)]
    q = FreeKVCacheBlockQueue(blocks)
    model = list(blocks)
    for _ in range(6000):
        op = rng.random()
        if op < 0.2 and model:
            n = rng.randint(1, min(8, len(model)))
            assert q.popleft_n(n) == model[:n]
            del model[:n]
        elif op < 0.7 and model:
            b = rng.choice(model)
            q.remove(b)
            model.remove(b)
            if op >= 0.3:
                q.append(b)
                model.append(b)
        else:
            free = [b for b in blocks if b not in model]
            back = rng.sample(free, min(len(free), rng.randint(0, 6)))
            q.extend(back)
            model += back
        assert q.num_free == len(model)
    assert list(q) == model
    back = [b for b in blocks if b not in model]
    q.extend(back)
    model += back
    for _ in range(1000):  # hits on free blocks without allocations: stale entries pile up
        b = rng.choice(model)
        q.remove(b)
        model.remove(b)
        if rng.random() < 0.8:
            q.append(b)
            model.append(b)
    assert list(q) == model and q.num_free == len(model)
    assert q.popleft_n(len(model)) == model and list(q) == []


def test_unhashed_at_head_is_what_peek_shows_through_allocations_hits_and_sweeps():
    """``unhashed_at_head()`` (whether ``n`` blocks are clean) against the blocks ``peek(n)``
    shows, asked between random allocations, registrations, prefix hits on free blocks (stale entries), frees, head
    compactions and stale sweeps: never True over a hashed block, and exact while no entry is
    stale (it may only be cautious about stale entries)."""
    rng = random.Random(5)
    pool = BlockPool(400)
    q = pool.free_queue
    held: list[KVCacheBlock] = []
    next_hash, answers = 0, {True: 0, False: 0}
    for step in range(8000):
        op = rng.random()
        if op < 0.3 and pool.num_free and step < 6000:
            got = pool.allocate(rng.randint(1, min(6, pool.num_free)))
            for block in got:
                if rng.random() < 0.4:
                    pool.cache(block, next_hash)
                    next_hash += 1
            held += got
        elif op < 0.5 and pool.cached and step < 6000:
            block = pool.lookup(rng.choice(list(pool.cached)))
            pool.touch([block])  # a prefix hit: a free block revived leaves a stale entry
            held.append(block)
        elif step >= 6000 and pool.cached:  # (at the end, hits whose requests end at once:
            # stale entries outnumber the free blocks and are swept)
            block = pool.lookup(rng.choice(list(pool.cached)))
            pool.touch([block])
            pool.free([block])
        elif held and step < 6000:
            rng.shuffle(held)
            k = rng.randint(1, min(8, len(held)))
            pool.free(held[:k])
            del held[:k]
        if step == 50:
            assert _clean_ahead(q, 0)  # (tracking starts here, with a queue already in use)
        if step > 50:
            n = rng.randint(0, 40)
            clean = all(b.block_hash is None for b in q.peek(n))
            answer = _clean_ahead(q, n)
            assert clean or not answer
            if not q._stale:
                assert answer == clean
            answers[answer] += 1
    assert answers[True] > 100 and answers[False] > 100, answers
    assert pool.num_evictions > 0


def _clean_ahead(q, n: int) -> bool:
    """Whether the queue's first ``n`` free blocks are clean, by ``unhashed_at_head``."""
    ahead = q.unhashed_at_head()
    return ahead is None or ahead >= n
