"""The hybrid KV cache manager: several KV cache groups (``core/kv_cache_groups.py``) over one
block pool, as vLLM v1's ``HybridKVCacheCoordinator``.

Each group is a one-group ``KVCacheManager`` with its own block table per request, sharing the
pool, the null block, the host pool and the queued copies: the full-attention group keeps every
block, a sliding group frees the blocks wholly outside its window. The public methods are
``KVCacheManager``'s, so the scheduler (and the twin) run it unchanged; the table they get back
is group 0's, whose ``group_ids`` carries every group's block ids for the backend.

Every mutation is all-or-nothing across the groups: ``allocate_slots`` counts each group's
blocks before taking any, adopts every group's prefix-cache hits before allocating (so one
group's new blocks never evict another's hit from the free queue), then grows each group::

    allocate_slots(request, n, hits)
      drop blocks outside each sliding window  ->  plan every group (blocks needed)
      sum > free?  -> None, nothing changed
      adopt hits: group 0 .. G-1   ->   copy-on-write + new blocks: group 0 .. G-1

Prefix caching: a hit must be valid for every group. The full group needs every block of the
prefix; a sliding group only the blocks its window still sees after the hit, the last
``cdiv(window - 1, block_size)`` (vLLM's rule). The hit is the longest prefix, within the full
group's, that every sliding group can serve; its earlier sliding places hold the null block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from twinserve.core.block_hash import update_block_hashes
from twinserve.core.block_pool import BlockPool, KVCacheBlock
from twinserve.core.kv_cache_manager import BlockTable, KVCacheManager, check_window, group_key
from twinserve.core.request import Request


class HybridKVCacheManager(KVCacheManager):
    """``KVCacheManager`` over the groups of ``group_windows`` (None: full attention)."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool = True,
                 num_cpu_blocks: int = 0, group_windows: Sequence[int | None] = ()) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}.")
        if num_gpu_blocks < 2:
            raise ValueError(f"a hybrid KV cache needs num_gpu_blocks >= 2 (one is the null "
                             f"block), got {num_gpu_blocks}.")
        for window in group_windows:
            check_window(window, "a group's window")
        kinds = set(group_windows)
        if len(group_windows) < 2 or None not in kinds or len(kinds) != 2:
            raise ValueError(f"a hybrid KV cache needs full-attention groups and groups of one "
                             f"sliding window; got group windows {tuple(group_windows)}.")
        pool = BlockPool(num_gpu_blocks, enable_caching)
        self._setup(block_size, enable_caching, None, pool, pool.allocate(1)[0],
                    BlockPool(num_cpu_blocks, enable_caching=False), None)
        # group 0 keys its cache entries by the plain hashes, group g by (hash, g)
        self.groups = tuple(KVCacheManager.group_of(self, w, g or None)
                            for g, w in enumerate(group_windows))
        self.group_windows = tuple(group_windows)
        self.tables = self.groups[0].tables  # what the scheduler reads: group 0's tables
        self.full_groups = tuple(g for g in self.groups if g.sliding_window is None)
        self.sliding_groups = tuple(g for g in self.groups if g.sliding_window is not None)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        return sum(g.max_blocks_held(num_tokens, max_chunk) for g in self.groups)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix every group can serve, in whole blocks: each group's hits, group
        after group, each ``num_hit_tokens / block_size`` long (what ``allocate_slots`` takes as
        ``computed_blocks``); a sliding group's places outside its window hold the null
        block."""
        if not self.enable_caching:
            return [], 0
        hashes = update_block_hashes(request, self.block_size, request.num_tokens - 1)
        cached = self.pool.cached
        full: list[list[KVCacheBlock]] = []
        num = len(hashes)
        for group in self.full_groups:
            hits = group.get_computed_blocks(request)[0]
            num = min(num, len(hits))
            full.append(hits)
        num = self._sliding_hit(hashes, num)
        null = self.null_block
        assert null is not None
        out: list[KVCacheBlock] = []
        full_hits = iter(full)
        for group in self.groups:
            window = group.sliding_window
            if window is None:
                out += next(full_hits)[:num]
                continue
            first = num - min(num, -(-(window - 1) // self.block_size))
            salt = group.key_salt
            out += [null] * first
            out += [cached[group_key(hashes[i], salt)] for i in range(first, num)]
        return out, num * self.block_size

    def _sliding_hit(self, hashes: list[int], limit: int) -> int:
        """The most blocks, at most ``limit``, after which every sliding group holds the blocks
        its window still sees: the last ``cdiv(window - 1, block_size)`` before the end, or
        every block when the hit is shorter than that."""
        cached = self.pool.cached
        need = max(-(-(g.sliding_window - 1) // self.block_size)  # type: ignore[operator]
                   for g in self.sliding_groups)
        salts = [g.key_salt for g in self.sliding_groups]
        run = 0  # cached blocks ending at i, scanning down from the limit
        for i in range(limit - 1, -1, -1):
            if all(group_key(hashes[i], salt) in cached for salt in salts):
                run += 1
                if run >= need:
                    return i + need
            else:
                run = 0
        return run  # the leading run (shorter than the window's blocks)

    # ---- mutators ------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None) -> BlockTable | None:
        groups = self.groups
        num_hits = len(computed_blocks) // len(groups) if computed_blocks else 0
        hits = [computed_blocks[g * num_hits:(g + 1) * num_hits] if computed_blocks else []
                for g in range(len(groups))]
        tables = self._tables(request)
        plans = []
        needed = 0
        for group, table, group_hits in zip(groups, tables, hits):
            if group.sliding_window is not None:
                group._drop_outside_window(table, request.num_computed_tokens)
            plan = group.plan_slots(table, request, num_new_tokens, group_hits)
            plans.append(plan)
            if plan is not None:
                needed += plan[0]
        if needed > self.pool.free_queue.num_free:
            return None
        if num_hits:
            num_computed = request.num_computed_tokens + num_hits * self.block_size
            for group, table, group_hits in zip(groups, tables, hits):
                group.adopt(table, group_hits, num_computed)
        for group, table, plan in zip(groups, tables, plans):
            if plan is not None:
                group.grow(table, request, num_hits, plan[1], plan[2])
        return tables[0]

    def _tables(self, request: Request) -> list[BlockTable]:
        """The request's table in every group (made on first use; group 0's lists them)."""
        tables = [g.table_for(request) for g in self.groups]
        if not tables[0].group_ids:
            tables[0].group_ids = tuple(t.ids for t in tables)
        return tables

    def append_slot(self, request: Request) -> BlockTable | None:
        table = self.tables[request.request_id]
        num_new_blocks = request.num_computed_tokens // self.block_size + 1 - len(table.blocks)
        if num_new_blocks <= 0:
            return table
        tables = self._tables(request)
        for group, group_table in zip(self.sliding_groups, self._sliding_tables(tables)):
            group._drop_outside_window(group_table, request.num_computed_tokens)
        if num_new_blocks * len(self.groups) > self.pool.free_queue.num_free:
            return None
        for group_table in tables:
            group_table.append(self.pool.allocate(num_new_blocks))
        return table

    def _sliding_tables(self, tables: list[BlockTable]) -> list[BlockTable]:
        return [t for g, t in zip(self.groups, tables) if g.sliding_window is not None]

    def cache_full_blocks(self, request: Request) -> None:
        for group in self.groups:
            group.cache_full_blocks(request)

    def free(self, request: Request) -> None:
        for group in self.groups:
            group.free(request)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        for group in self.groups:
            group.free_tail(request, num_tokens)

    def fork(self, parent: Request, child: Request) -> None:
        for group in self.groups:
            group.fork(parent, child)
        self._tables(child)

    def swap_out(self, request: Request) -> bool:
        tables = self._tables(request)
        n = sum(len(t.blocks) - t.num_dropped for t in tables)
        if n == 0 or n > self.host_pool.num_free:
            return False
        for group in self.groups:
            group.swap_out(request)  # a group left with no blocks keeps none: nothing to move
        return True

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        total = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens)
        needed = 0
        for table in self._tables(request):
            num_host = len(table.host_blocks)
            needed += num_host + max(0, total - table.num_dropped - num_host)
        return needed <= self.pool.num_free

    def swap_in(self, request: Request) -> None:
        for group in self.groups:
            group.swap_in(request)

    # ---- checks --------------------------------------------------------------------------
    def all_tables(self) -> Iterable[BlockTable]:
        for group in self.groups:
            yield from group.tables.values()

    def check_consistency(self) -> None:
        """``KVCacheManager``'s audit over every group's tables, and every group holding a
        table of the same length for each request."""
        super().check_consistency()
        for rid, table in self.tables.items():
            lengths = {len(g.tables[rid].blocks) + len(g.tables[rid].host_blocks)
                       for g in self.groups}
            if len(lengths) != 1:
                raise AssertionError(f"request {rid!r}: its groups' tables differ in length")
            if tuple(map(id, table.group_ids)) != tuple(id(g.tables[rid].ids) for g in self.groups):
                raise AssertionError(f"request {rid!r}: group_ids are not its tables' ids")


def make_kv_cache_manager(num_gpu_blocks: int, block_size: int, enable_caching: bool = True,
                          num_cpu_blocks: int = 0, sliding_window: int | None = None,
                          group_windows: Sequence[int | None] = ()) -> KVCacheManager:
    """The manager of a scheduler: hybrid for several groups' windows (``group_windows``), else
    the one-group ``KVCacheManager`` (every layer within ``sliding_window``, or full)."""
    if len(group_windows) > 1:
        if sliding_window is not None:
            raise ValueError("sliding_window applies to one-group layouts; a hybrid layout "
                             "gives each group its window (kv_cache_group_windows).")
        return HybridKVCacheManager(num_gpu_blocks, block_size, enable_caching, num_cpu_blocks,
                                    group_windows)
    return KVCacheManager(num_gpu_blocks, block_size, enable_caching, num_cpu_blocks,
                          sliding_window)
