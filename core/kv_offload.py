"""The host-memory KV tier, scheduler side: vLLM's ``OffloadingConnector`` (``--kv-offloading-size``).

A bounded LRU of host blocks keyed by prefix-cache block hash (``core.block_hash``), shared by the
real engine and the twin; their worker sides (``gpu/kv_offload/``, ``simulator/kv_offload.py``)
perform the copies this side orders::

    schedule(now)
      admission: device hits -> get_num_new_matched_tokens: the following whole blocks found in
                 host (never the last prompt token) -> blocks allocated -> update_state_after_alloc
                 orders their load; the request waits (WAITING_FOR_REMOTE_KVS) without a step
      build_connector_meta: loads ordered at admission (host -> device, before the forward pass)
                 and stores of every full block the step completes that host lacks (device -> host,
                 after the forward pass), host LRU blocks evicted to make room
    update_connector_output: loads finished or failed; the step's stores done (their pins go)

Decisions:
- Loads are asynchronous, as vLLM's: the request leaves the step while its blocks arrive, so a
  long reload never stalls the running batch (on the CPU the worker copies at once; on CUDA the
  copies run on a side stream the forward pass waits for).
- A host block being loaded or stored is pinned: eviction skips it, so its slot is never reused
  while a copy reads or writes it. When every host block is pinned, the remaining stores of the
  step are skipped and retried at the next step (the request's store cursor stays put).
- Stores of a step are done when the step's worker output comes back (the worker orders them
  before the next forward pass), so the device blocks of a request that finishes in that step are
  never read after the scheduler frees them; no delayed free is needed.
- Each request keeps a store cursor (its leading full blocks already handled), so a step costs
  O(new full blocks), not O(blocks held). Host hits count as vLLM's external prefix cache
  queries and hits (tokens; ``external_prefix_cache_*``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from twinserve.core.block_hash import update_block_hashes
from twinserve.core.kv_connector import KVConnectorMetadata, KVConnectorOutput
from twinserve.core.kv_transfer_config import KVTransferConfig
from twinserve.core.outputs import SchedulerOutput
from twinserve.core.request import Request

OFFLOADING_CONNECTOR = "OffloadingConnector"
OFFLOADING_BACKENDS = ("native",)  # vLLM's --kv-offloading-backend values twinserve implements
GiB = 1 << 30


def check_kv_offloading(size_gib: float | None, backend: str) -> None:
    """Raises ValueError naming the argument: a size that is not a positive number of GiB, or
    a backend twinserve lacks (vLLM's ``lmcache``)."""
    if size_gib is not None and (isinstance(size_gib, bool) or not isinstance(size_gib, (int, float))
                                 or not size_gib > 0):
        raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size_gib!r}.")
    if backend not in OFFLOADING_BACKENDS:
        raise ValueError(f"kv_offloading_backend {backend!r} is not implemented in twinserve "
                         f"(implemented: {', '.join(OFFLOADING_BACKENDS)}).")


def num_host_blocks(kv_offloading_size_gib: float, bytes_per_block: int) -> int:
    """Host blocks in ``kv_offloading_size_gib`` GiB for a KV layout of ``bytes_per_block``
    (keys and values of one block, all layers)."""
    if isinstance(kv_offloading_size_gib, bool) or not isinstance(kv_offloading_size_gib, (int, float)) \
            or not kv_offloading_size_gib > 0:
        raise ValueError(f"kv_offloading_size must be a positive number of GiB, got "
                         f"{kv_offloading_size_gib!r}.")
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}.")
    blocks = int(kv_offloading_size_gib * GiB) // bytes_per_block
    if blocks <= 0:
        raise ValueError(f"kv_offloading_size ({kv_offloading_size_gib} GiB) holds no KV block of "
                         f"{bytes_per_block} bytes.")
    return blocks


def offloading_config(num_cpu_blocks: int) -> KVTransferConfig:
    """The ``kv_transfer_config`` that ``--kv-offloading-size`` stands for, once the size is in
    blocks (vLLM's OffloadingConnector with ``num_cpu_blocks``)."""
    return KVTransferConfig(kv_connector=OFFLOADING_CONNECTOR, kv_role="kv_both",
                            kv_connector_extra_config={"num_cpu_blocks": num_cpu_blocks})


@dataclass(slots=True)
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """One step's orders to the host tier's worker side."""

    # request id -> (host block, device block) pairs, copied before the forward pass
    loads: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # (device block, host block) pairs, copied after the forward pass
    stores: list[tuple[int, int]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # loads abandoned (aborted requests)


@dataclass(slots=True)
class OffloadingStats:
    """Counters of the tier since start. Queries and hits in tokens, as vLLM's
    ``vllm:external_prefix_cache_queries`` / ``_hits``; blocks for the rest."""

    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_blocks_stored: int = 0
    num_blocks_loaded: int = 0
    num_blocks_evicted: int = 0
    num_failed_loads: int = 0
    num_host_blocks: int = 0  # the tier's capacity


class HostBlockLRU:
    """``capacity`` host block slots keyed by block hash, least recently used first.

    ``OrderedDict`` gives O(1) touch and insertion; eviction walks from the oldest entry past the
    pinned ones (at most the blocks in flight)."""

    __slots__ = ("capacity", "_slots", "_free", "_pins")

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"num_host_blocks must be a positive integer, got {capacity!r}.")
        self.capacity = capacity
        self._slots: OrderedDict[int, int] = OrderedDict()  # block hash -> host slot
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: slot 0 first
        self._pins: dict[int, int] = {}  # host slot -> pin count

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, block_hash: int) -> int | None:
        return self._slots.get(block_hash)

    def touch(self, block_hash: int) -> None:
        self._slots.move_to_end(block_hash)

    def insert(self, block_hash: int) -> tuple[int, int | None] | None:
        """A slot for a new ``block_hash`` (most recently used): a free one, else the least
        recently used unpinned one's. Returns (slot, evicted hash or None), or None when every
        slot is pinned."""
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            for old, slot in self._slots.items():
                if slot not in self._pins:
                    evicted = old
                    break
            else:
                return None
            del self._slots[evicted]
        self._slots[block_hash] = slot
        return slot, evicted

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        count = self._pins[slot] - 1
        if count:
            self._pins[slot] = count
        else:
            del self._pins[slot]

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def check_consistency(self) -> None:
        """Audit for tests: slots unique and within capacity, free and used disjoint."""
        used = list(self._slots.values())
        if len(used) + len(self._free) != self.capacity or len(set(used) | set(self._free)) != self.capacity:
            raise AssertionError("host slots lost or duplicated")
        if any(count <= 0 or not 0 <= slot < self.capacity for slot, count in self._pins.items()):
            raise AssertionError("a pin count or pinned slot is out of range")


class OffloadingConnectorScheduler:
    """The scheduler side of the host tier (``KVConnectorScheduler``); its size is the
    config's ``kv_connector_extra_config["num_cpu_blocks"]``."""

    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}.")
        num_host_blocks = config.kv_connector_extra_config.get("num_cpu_blocks")
        if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int) \
                or num_host_blocks <= 0:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.num_cpu_blocks must "
                             f"be a positive integer for the OffloadingConnector, got "
                             f"{num_host_blocks!r}.")
        self.config = config
        self.block_size = block_size
        self.lru = HostBlockLRU(num_host_blocks)
        self.stats = OffloadingStats(num_host_blocks=num_host_blocks)
        self._store_cursor: dict[str, int] = {}  # request id -> leading full blocks handled
        self._matched: dict[str, tuple[int, list[int]]] = {}  # id -> (first block, host slots)
        self._queries: dict[str, int] = {}  # id -> tokens of a lookup not yet counted
        self._loads: dict[str, list[tuple[int, int]]] = {}  # ordered, not yet sent
        self._loading: dict[str, list[int]] = {}  # id -> pinned host slots of its load
        self._store_pins: list[int] = []
        self._cancelled: list[str] = []

    # ---- admission -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past the device's ``num_computed_tokens`` found in host, in whole blocks and
        never the last token (its logits are needed); loaded asynchronously."""
        rid = request.request_id
        self._queries[rid] = request.num_tokens
        bs = self.block_size
        if num_computed_tokens % bs or request.sampling_params.skip_reading_prefix_cache:
            return 0, False
        first = num_computed_tokens // bs
        hashes = update_block_hashes(request, bs, request.num_tokens - 1)
        lookup = self.lru.get
        slots = []
        for h in hashes[first:]:
            slot = lookup(h)
            if slot is None:
                break
            slots.append(slot)
        if not slots:
            self._matched.pop(rid, None)
            return 0, False
        self._matched[rid] = (first, slots)
        return len(slots) * bs, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """Orders the load of the matched host blocks into the request's newly allocated ones
        (``block_ids``: its whole table) and pins them until the load is reported."""
        rid = request.request_id
        matched = self._matched.pop(rid, None)
        self._count_query(rid, num_external_tokens)
        if not num_external_tokens:
            return
        if matched is None or num_external_tokens % self.block_size:
            raise ValueError(f"num_external_tokens {num_external_tokens} for {rid!r} was not "
                             "matched by get_num_new_matched_tokens in whole blocks.")
        first, slots = matched
        n = num_external_tokens // self.block_size
        slots = slots[:n]
        if len(slots) < n:
            raise ValueError(f"num_external_tokens {num_external_tokens} for {rid!r} exceeds the "
                             f"{len(slots) * self.block_size} tokens matched.")
        local = block_ids[first:first + n]
        for slot in slots:
            self.lru.pin(slot)
        self._loading[rid] = slots
        self._loads[rid] = list(zip(slots, local))
        self._store_cursor[rid] = first + n  # (those blocks are in host already)
        self.stats.num_blocks_loaded += n

    def _count_query(self, rid: str, num_hit_tokens: int) -> None:
        queried = self._queries.pop(rid, None)
        if queried is not None:
            self.stats.external_prefix_cache_queries += queried
            self.stats.external_prefix_cache_hits += num_hit_tokens

    # ---- each step -----------------------------------------------------------------------
    def build_connector_meta(self, out: SchedulerOutput) -> OffloadingConnectorMetadata:
        # The last step's stores are done by now (its worker report came back before this
        # schedule); released here too in case a loop dropped an empty report.
        self._release_store_pins()
        meta = OffloadingConnectorMetadata(self._loads, [], self._cancelled)
        self._loads, self._cancelled = {}, []
        queries = self._queries
        for sr in out.scheduled:
            request = sr.request
            if queries:  # admitted from local hits alone (no update_state_after_alloc)
                self._count_query(request.request_id, 0)
            # drafts may be rejected: only the tokens certain to be kept complete blocks
            done = sr.start + sr.num_new_tokens - len(sr.spec_token_ids)
            if done // self.block_size > self._store_cursor.get(request.request_id, 0):
                self._order_stores(request, sr.block_ids, done // self.block_size, meta.stores)
        return meta

    def _order_stores(self, request: Request, block_ids: list[int], num_full: int,
                      stores: list[tuple[int, int]]) -> None:
        """Stores of the request's full blocks from its cursor to ``num_full`` that host lacks
        (those it has become most recently used)."""
        rid, lru, stats = request.request_id, self.lru, self.stats
        first = self._store_cursor.get(rid, 0)
        hashes = update_block_hashes(request, self.block_size, num_full * self.block_size)
        for i in range(first, num_full):
            h = hashes[i]
            if lru.get(h) is not None:
                lru.touch(h)
                continue
            got = lru.insert(h)
            if got is None:  # every host block is in flight: retry from here next step
                self._store_cursor[rid] = i
                return
            slot, evicted = got
            if evicted is not None:
                stats.num_blocks_evicted += 1
            lru.pin(slot)
            self._store_pins.append(slot)
            stores.append((block_ids[i], slot))
            stats.num_blocks_stored += 1
        self._store_cursor[rid] = num_full

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker's report of a step: loads finished or failed; the step's stores done."""
        for rid in output.finished_recving:
            self._release_load(rid)
        for rid in output.failed_recving:
            self._release_load(rid)
            self.stats.num_failed_loads += 1
        self._release_store_pins()

    def _release_store_pins(self) -> None:
        unpin = self.lru.unpin
        for slot in self._store_pins:
            unpin(slot)
        self._store_pins = []

    def _release_load(self, rid: str) -> None:
        for slot in self._loading.pop(rid, ()):
            self.lru.unpin(slot)

    # ---- leaving -------------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forgets the request (a load in flight is cancelled); its blocks are freed at once
        (this step's stores precede any reuse: see the module's decisions)."""
        self.request_aborted(request.request_id)
        return False, None

    def request_aborted(self, request_id: str) -> None:
        """Cancels a load in flight (its host blocks unpinned, the worker told) and forgets."""
        if request_id in self._loading:
            self._release_load(request_id)
            if self._loads.pop(request_id, None) is None:  # already sent to the worker
                self._cancelled.append(request_id)
        self._forget(request_id)

    def _forget(self, rid: str) -> None:
        self._store_cursor.pop(rid, None)
        self._matched.pop(rid, None)
        self._queries.pop(rid, None)
