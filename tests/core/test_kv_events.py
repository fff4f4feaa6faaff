"""KV-cache events from the block pool: off by default, stored/removed/cleared, bounded."""

from __future__ import annotations

import pytest
from core_helpers import make_req, make_scheduler, run_to_completion

from twinserve.core.block_hash import update_block_hashes
from twinserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBuffer


def test_off_by_default_records_nothing() -> None:
    sched = make_scheduler()
    assert sched.kv.pool.events is None
    sched.add_request(make_req("a", 20))
    run_to_completion(sched)
    assert sched.take_kv_events() == []


def test_stored_then_removed_when_evicted_then_cleared() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, kv_events=True)
    a = make_req("a", 17, prefix=list(range(17)))
    sched.add_request(a)
    run_to_completion(sched)
    events = sched.take_kv_events()
    hashes = update_block_hashes(a, 4, 16)
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored[:4] == hashes[:4]
    first = next(e for e in events if isinstance(e, BlockStored))
    assert first.parent_block_hash is None and first.lora is None
    assert sched.take_kv_events() == []  # drained
    b = make_req("b", 28)  # needs 7 of 8 blocks: evicts a's cached blocks
    sched.add_request(b)
    run_to_completion(sched)
    removed = [h for e in sched.take_kv_events() if isinstance(e, BlockRemoved)
               for h in e.block_hashes]
    assert set(hashes[:4]) & set(removed)
    assert sched.kv.reset_prefix_cache()
    assert sched.take_kv_events() == [AllBlocksCleared()]


def test_the_buffer_is_bounded() -> None:
    buffer = KVEventBuffer(capacity=3)
    for i in range(5):
        buffer.stored([i], None, None)
        buffer.removed(i)
    taken = buffer.take()
    assert len(taken) <= 3 and buffer.num_overflows > 0
    assert isinstance(taken[0], AllBlocksCleared)
    with pytest.raises(ValueError, match="capacity"):
        KVEventBuffer(capacity=0)
