"""Per-request block tables over a device ``BlockPool``, with prefix caching, copy-on-write for
forked requests (n > 1) and swapping to a bounded host pool.

The manager owns the blocks; the request owns its token state. Predicates (``can_swap_in``) stand
apart from mutators (``allocate_slots``, ``free``, ``swap_out``, ``swap_in``). Block copies the
backend must perform are queued in ``block_ops`` and drained once per step with ``take_block_ops``.

Sliding-window attention (``sliding_window``: every layer attends to at most that many tokens,
its own included) frees the blocks wholly outside the window, as vLLM's sliding-window manager
does, so a long sequence holds about ``window / block_size + 1`` blocks::

    positions   0..15   16..31   32..47   48..63 | next query at 60, window 24: keys 37..60
    table       [null]  [null ]  [ b7  ]  [ b9  ]   blocks 0 and 1 freed, their slots -> null

A freed block's place in the table holds the manager's ``null_block`` (one block taken from the
pool at start, never written and never read: the kernels attend only inside the window), so a
position's block is still ``table[pos // block_size]``. Freed blocks keep their prefix-cache hash
until evicted; a lookup still needs every block of the prefix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from twinserve.core.block_hash import update_block_hashes
from twinserve.core.block_pool import BlockPool, KVCacheBlock
from twinserve.core.request import Request

_block_id = attrgetter("block_id")


def check_window(window: int | None, name: str = "sliding_window") -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window <= 0):
        raise ValueError(f"{name} must be a positive integer or None, got {window!r}.")


def group_key(block_hash: int, salt: int | None) -> int:
    """A block hash as a group's prefix-cache key (groups share one pool's index)."""
    return block_hash if salt is None else hash((block_hash, salt))


@dataclass(slots=True)
class BlockTable:
    """A request's blocks in order; ``ids`` mirrors ``blocks`` for the backend."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading full blocks already registered in the prefix cache
    num_dropped: int = 0  # leading blocks freed outside the sliding window (null_block there)
    host_blocks: list[KVCacheBlock] = field(default_factory=list)  # while swapped out
    # Hybrid layouts (several KV cache groups): on group 0's table, every group's live ``ids``
    # (``group_ids[0] is ids``); empty with one group.
    group_ids: tuple[list[int], ...] = ()

    def append(self, blocks: list[KVCacheBlock]) -> None:
        self.blocks += blocks
        self.ids += map(_block_id, blocks)


@dataclass(slots=True)
class BlockOps:
    """Copies the backend performs before the forward pass, in this order."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    copy: list[tuple[int, int]] = field(default_factory=list)      # (src, dst) copy-on-write


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool = True,
                 num_cpu_blocks: int = 0, sliding_window: int | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}.")
        if num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_gpu_blocks}.")
        check_window(sliding_window)
        if sliding_window is not None and num_gpu_blocks < 2:
            raise ValueError("sliding_window needs num_gpu_blocks >= 2 (one is the null block).")
        pool = BlockPool(num_gpu_blocks, enable_caching)
        # Placeholder of freed out-of-window blocks; held by the manager (ref_cnt 1) for good.
        null_block = pool.allocate(1)[0] if sliding_window is not None else None
        self._setup(block_size, enable_caching, sliding_window, pool, null_block,
                    BlockPool(num_cpu_blocks, enable_caching=False), None)
        # One group of full attention: a block holding a request's own tokens is registered
        # only if the request is preempted (``Request.own_ids_from``, ``register_own``).
        self.defers_own_blocks = enable_caching and sliding_window is None

    def _setup(self, block_size: int, enable_caching: bool, sliding_window: int | None,
               pool: BlockPool, null_block: KVCacheBlock | None, host_pool: BlockPool,
               key_salt: int | None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = pool
        self.null_block = null_block
        self.host_pool = host_pool
        # A hybrid layout's groups share the pool: each keys its prefix-cache entries apart
        # (None: the plain block hashes, group 0's and a one-group manager's).
        self.key_salt = key_salt
        self.tables: dict[str, BlockTable] = {}
        # Copies queued for the backend since the last ``take_block_ops``; None while there are
        # none (the scheduler tests this attribute every step). A group queues on its owner's.
        self.block_ops: BlockOps | None = None
        self.ops_owner: KVCacheManager = self
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0     # tokens found
        self.defers_own_blocks = False

    @classmethod
    def group_of(cls, owner: KVCacheManager, sliding_window: int | None,
                 key_salt: int | None) -> KVCacheManager:
        """One KV cache group of a hybrid ``owner``: its own tables over the owner's pools,
        null block and queued copies."""
        group = cls.__new__(cls)
        group._setup(owner.block_size, owner.enable_caching, sliding_window, owner.pool,
                     owner.null_block, owner.host_pool, key_salt)
        group.ops_owner = owner
        return group

    # ---- queries -------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_ids(self, request: Request) -> list[int]:
        return self.tables[request.request_id].ids

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_groups(self) -> int:
        """KV cache groups: a decode that starts a block takes this many (one per group)."""
        return 1

    @property
    def num_usable_blocks(self) -> int:
        """The blocks requests can hold (all but the null block)."""
        return self.pool.num_blocks - (self.null_block is not None)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a sequence of ``num_tokens`` holds at once when each step computes at
        most ``max_chunk`` of its tokens: all of them, or, with a sliding window, the window's
        and one chunk's (a step from position c keeps blocks from (c - window + 1) // block_size
        up to the one holding c + chunk - 1)."""
        full = self.num_blocks_needed(num_tokens)
        if self.sliding_window is None:
            return full
        return min(full, self.num_blocks_needed(self.sliding_window - 1 + max_chunk) + 1)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a request with no computed tokens, in whole blocks. The last
        token is always recomputed so the backend has logits to sample from."""
        if not self.enable_caching:
            return [], 0
        max_hit_tokens = request.num_tokens - 1
        first_own = self._first_own_block(request)
        if first_own is not None:  # its own blocks cannot be cached yet
            max_hit_tokens = min(max_hit_tokens, first_own * self.block_size)
        hashes = update_block_hashes(request, self.block_size, max_hit_tokens)
        hits: list[KVCacheBlock] = []
        lookup = self.pool.cached.get
        salt = self.key_salt
        for h in hashes:
            block = lookup(h if salt is None else group_key(h, salt))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts a lookup once its request is admitted (retries are not queries)."""
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    # ---- mutators ------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None) -> BlockTable | None:
        """Makes room for ``num_new_tokens`` more tokens after the computed ones (and after
        ``computed_blocks``, prefix-cache hits being adopted). Returns None, changing nothing,
        when the free blocks do not suffice; the scheduler then preempts."""
        table = self.table_for(request)
        hits = computed_blocks or ()
        if self.sliding_window is not None:
            # Blocks the coming queries cannot see are freed first, even if the allocation then
            # fails: they are not needed either way.
            self._drop_outside_window(table, request.num_computed_tokens)
        plan = self.plan_slots(table, request, num_new_tokens, hits)
        if plan is None:  # e.g. a decode whose slot lies in its own last block
            return table
        needed, num_new_blocks, cow = plan
        if needed > self.pool.free_queue.num_free:
            return None
        if hits:
            self.adopt(table, list(hits), request.num_computed_tokens + len(hits) * self.block_size)
        self.grow(table, request, len(hits), num_new_blocks, cow)
        return table

    def table_for(self, request: Request) -> BlockTable:
        table = self.tables.get(request.request_id)
        if table is None:
            table = self.tables[request.request_id] = BlockTable()
        return table

    def plan_slots(self, table: BlockTable, request: Request, num_new_tokens: int,
                   hits: Sequence[KVCacheBlock]) -> tuple[int, int, bool] | None:
        """What ``allocate_slots`` takes from the free queue, changing nothing: ``(blocks
        needed, new blocks, copy-on-write)``; None when it needs nothing at all."""
        bs = self.block_size
        blocks = table.blocks
        num_computed = request.num_computed_tokens + len(hits) * bs
        num_new_blocks = -(-(num_computed + num_new_tokens) // bs) - len(blocks) - len(hits)
        write_idx = num_computed // bs
        cow = write_idx < len(blocks) and blocks[write_idx].ref_cnt > 1
        if num_new_blocks <= 0:
            if not cow and not hits:
                return None
            num_new_blocks = 0
        needed = num_new_blocks + cow
        if hits:  # free cached blocks to revive (those the window keeps)
            needed += sum(1 for b in hits[self._num_outside(num_computed, len(hits)):]
                          if not b.ref_cnt)
        return needed, num_new_blocks, cow

    def grow(self, table: BlockTable, request: Request, num_hits: int, num_new_blocks: int,
             cow: bool) -> None:
        """The second half of ``allocate_slots`` once the hits are adopted: the copy of a
        shared block about to be written, then the new blocks."""
        if cow:
            self._copy_on_write(table, (request.num_computed_tokens + num_hits * self.block_size)
                                // self.block_size)
        if num_new_blocks > 0:
            table.append(self.pool.allocate(num_new_blocks))

    def _num_outside(self, num_computed: int, num_blocks: int) -> int:
        """Leading blocks (of ``num_blocks``) that no query from ``num_computed`` on can see."""
        if self.sliding_window is None:
            return 0
        return min(num_blocks, max(0, num_computed - self.sliding_window + 1) // self.block_size)

    def adopt(self, table: BlockTable, hits: list[KVCacheBlock], num_computed: int) -> None:
        """Prefix-cache hits into a new request's table; with a window, the hits outside it are
        not revived: their places hold the null block."""
        skip = self._num_outside(num_computed, len(hits))
        if skip and self.null_block is not None:
            hits[:skip] = [self.null_block] * skip
        self.pool.touch(hits[skip:])
        table.append(hits)
        table.num_dropped = skip
        table.num_cached_blocks = len(table.blocks)

    def append_slot(self, request: Request) -> BlockTable | None:
        """``allocate_slots(request, 1)`` for a running request none of whose blocks is shared
        with another (no forked samples, so no copy-on-write): the decode's path to a new block."""
        table = self.tables[request.request_id]
        num_new_blocks = request.num_computed_tokens // self.block_size + 1 - len(table.blocks)
        if num_new_blocks <= 0:
            return table
        if self.sliding_window is not None:
            self._drop_outside_window(table, request.num_computed_tokens)
        if num_new_blocks > self.pool.free_queue.num_free:
            return None
        table.append(self.pool.allocate(num_new_blocks))
        return table

    def _drop_outside_window(self, table: BlockTable, num_computed: int) -> None:
        """Frees the blocks no query from position ``num_computed`` on can see (it attends to
        positions > its own - window) and puts ``null_block`` in their places."""
        null = self.null_block
        if null is None:
            return
        end = self._num_outside(num_computed, len(table.blocks))
        start = table.num_dropped
        if end <= start:
            return
        dropped = table.blocks[start:end]
        table.blocks[start:end] = [null] * (end - start)
        table.ids[start:end] = [null.block_id] * (end - start)
        table.num_dropped = end
        self.pool.free(reversed(dropped))

    def _copy_on_write(self, table: BlockTable, idx: int) -> None:
        old = table.blocks[idx]
        (new,) = self.pool.allocate(1)
        self._queued_ops().copy.append((old.block_id, new.block_id))
        self.pool.free([old])
        table.blocks[idx] = new
        table.ids[idx] = new.block_id
        table.num_cached_blocks = min(table.num_cached_blocks, idx)

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's newly computed full blocks in the prefix cache."""
        table = self.tables[request.request_id]
        num_full = request.num_computed_tokens // self.block_size
        if not self.enable_caching or num_full <= table.num_cached_blocks:
            return
        stop = self.registration_stop(request, table.num_cached_blocks, num_full)
        first = max(table.num_cached_blocks, table.num_dropped)  # never cache the null block
        if first < stop:
            self._register(request, table, first, stop)
        table.num_cached_blocks = num_full  # (the request's own blocks after ``stop``: deferred)

    def _first_own_block(self, request: Request) -> int | None:
        """The first block holding the request's own tokens where this manager defers them
        (``Request.own_ids_from``), else None."""
        own = request.own_ids_from
        return None if own is None or not self.defers_own_blocks else own // self.block_size

    def registration_stop(self, request: Request, num_cached: int, num_full: int) -> int:
        """Where registering a request's full blocks past ``num_cached`` stops: ``num_full``,
        or the first block holding its own tokens (``register_own`` registers the rest).
        (``_first_own_block`` inline: a decode run asks this of each request it fills a
        block of.)"""
        own = request.own_ids_from
        if own is None or not self.defers_own_blocks:
            return num_full
        first_own = own // self.block_size
        return min(num_full, first_own if first_own > num_cached else num_cached)

    def _register(self, request: Request, table: BlockTable, first: int, stop: int) -> None:
        hashes = update_block_hashes(request, self.block_size, stop * self.block_size)
        salt = self.key_salt
        if self.pool.events is not None:  # recorded for routers (core.kv_events)
            keys = hashes[first - 1:stop] if first else [None, *hashes[:stop]]
            if salt is not None:
                keys = [k if k is None else hash((k, salt)) for k in keys]
            self.pool.cache_recorded(table.blocks[first:stop], keys[1:], keys[0],  # type: ignore[arg-type]
                                    request.lora)
        elif salt is not None:  # a hybrid layout's group: its own keys for the new blocks only
            self.pool.cache_all(table.blocks[first:stop],
                                [hash((h, salt)) for h in hashes[first:stop]])
        elif first + 1 == stop:  # one block (a decode crossed a boundary): no slices
            self.pool.cache(table.blocks[first], hashes[first])
        else:
            self.pool.cache_all(table.blocks[first:stop], hashes[first:stop])

    def register_own(self, request: Request) -> None:
        """Registers the request's deferred full blocks (those holding its own tokens) before
        it is preempted, as if each had been registered when it filled (no other request can
        have cached their hashes in between); from then on its blocks are registered as they
        fill, like any request's."""
        first_own = self._first_own_block(request)
        request.own_ids_from = None
        table = self.tables.get(request.request_id)
        if first_own is None or table is None:
            return
        first = max(first_own, table.num_dropped)
        if first < table.num_cached_blocks:
            self._register(request, table, first, table.num_cached_blocks)

    def free(self, request: Request) -> None:
        """Releases a request's blocks (device and host); tail blocks are evicted first."""
        table = self.tables.pop(request.request_id, None)
        if table is None:
            return
        self.pool.free(reversed(table.blocks[table.num_dropped:]))
        self.host_pool.free(table.host_blocks)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Releases the request's blocks past those ``num_tokens`` tokens need (speculation:
        the lookahead slots of rejected drafts). Such blocks were never registered in the
        prefix cache: only blocks of verified tokens are."""
        table = self.tables.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if table is None or len(table.blocks) <= keep:
            return
        tail = table.blocks[keep:]
        del table.blocks[keep:], table.ids[keep:]  # in place: entries hold ``ids``
        table.num_cached_blocks = min(table.num_cached_blocks, keep)
        self.pool.free(reversed(tail))

    def fork(self, parent: Request, child: Request) -> None:
        """Child shares all of the parent's blocks; a later write into a shared block copies it."""
        src = self.tables[parent.request_id]
        table = self.tables[child.request_id] = BlockTable(num_cached_blocks=src.num_cached_blocks,
                                                           num_dropped=src.num_dropped)
        self.pool.touch(src.blocks[src.num_dropped:])
        table.append(list(src.blocks))

    def swap_out(self, request: Request) -> bool:
        """Moves a request's blocks to the host pool; False (nothing changed) if it lacks room."""
        table = self.tables[request.request_id]
        dropped = table.num_dropped
        n = len(table.blocks) - dropped
        if n == 0 or n > self.host_pool.num_free:
            return False
        host = self.host_pool.allocate(n)
        self._queued_ops().swap_out.extend(zip(table.ids[dropped:], (b.block_id for b in host)))
        self.pool.free(reversed(table.blocks[dropped:]))
        del table.blocks[dropped:], table.ids[dropped:]  # in place: ``group_ids`` holds ids
        table.host_blocks = host
        table.num_cached_blocks = dropped  # the null places are never cached again
        return True

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        """Room for the swapped blocks and for ``num_new_tokens`` more tokens after them."""
        table = self.tables[request.request_id]
        num_host = len(table.host_blocks)
        total = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens)
        # the table keeps its dropped (null) places while swapped out
        return num_host + max(0, total - table.num_dropped - num_host) <= self.pool.num_free

    def swap_in(self, request: Request) -> None:
        table = self.tables[request.request_id]
        device = self.pool.allocate(len(table.host_blocks))
        self._queued_ops().swap_in.extend(
            (h.block_id, d.block_id) for h, d in zip(table.host_blocks, device))
        self.host_pool.free(table.host_blocks)
        table.host_blocks = []
        table.append(device)

    def _queued_ops(self) -> BlockOps:
        owner = self.ops_owner
        if owner.block_ops is None:
            owner.block_ops = BlockOps()
        return owner.block_ops

    def take_block_ops(self) -> BlockOps:
        ops, self.block_ops = self.block_ops, None
        return BlockOps() if ops is None else ops

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache(self.null_block is not None)

    # ---- checks --------------------------------------------------------------------------
    def all_tables(self) -> Iterable[BlockTable]:
        """Every request's table of every group."""
        return self.tables.values()

    def check_consistency(self) -> None:
        """Full audit (O(blocks)), for tests: reference counts equal the table references, the
        free queue holds exactly the unreferenced blocks, and its counter is its length, on both
        pools; table ids mirror table blocks."""
        null = self.null_block
        tables = list(self.all_tables())
        for table in tables:
            if table.ids != [b.block_id for b in table.blocks]:
                raise AssertionError("a block table's ids differ from its blocks")
            if any((b is null) != (i < table.num_dropped) for i, b in enumerate(table.blocks)):
                raise AssertionError("the null block is not exactly the dropped prefix")
        for pool, attr in ((self.pool, "blocks"), (self.host_pool, "host_blocks")):
            refs: dict[int, int] = {} if null is None or attr != "blocks" else {null.block_id: 1}
            for table in tables:
                for b in getattr(table, attr):
                    if b is not null:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
            queued = [b.block_id for b in pool.free_queue]
            free = {b.block_id for b in pool.blocks if b.ref_cnt == 0}
            for b in pool.blocks:
                if b.ref_cnt != refs.get(b.block_id, 0):
                    raise AssertionError(f"block {b.block_id}: ref_cnt {b.ref_cnt} != "
                                         f"{refs.get(b.block_id, 0)} table references")
            if len(queued) != len(set(queued)) or set(queued) != free:
                raise AssertionError("free queue membership differs from the unreferenced blocks")
            if len(queued) != pool.num_free:
                raise AssertionError("free queue length differs from its counter")
