"""The cache-aware router: prefix blocks each replica holds (from its KV events) against load."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from twinserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from twinserve.core.request import Request
from twinserve.routers.hashing import prompt_block_hashes
from twinserve.routers.router import ReplicaLoad, healthy

_INF = float("inf")
# Bounds of the walks kept (cleared past them).
_MAX_WALKS = 1024
_MAX_READERS = 1 << 17


class CacheAwareRouter:
    """Sends each request to the healthy replica where its first token would come soonest: the
    prompt blocks a replica already holds (llm-d's precise prefix-cache scorer) priced together
    with the work ahead of it there, in one unit, prompt tokens.

    What a replica holds comes only from its own KV events (``core.kv_events``): one index,
    block hash -> the replicas holding it (a bit each), of at most ``max_blocks`` hashes, kept in
    two generations (``hashlru``'s LRU of two segments, forgotten a segment at a time): a hash
    stored joins the young generation, a hash matched moves up to it from the old one, and once
    the young one holds half the cap the old one is forgotten and it becomes the old. Forgetting
    can only make a replica look emptier than it is. Where the replicas hold fewer hashes than
    half the cap (the default's 131,072; 4 replicas of ~28,000 blocks) nothing is forgotten and
    no order is kept: an exact LRU reordered every hash stored and matched for an eviction that
    never came.

    The cost of replica ``i``, in prompt tokens::

        prefill_tokens_per_s * step_left_s_i   # the wait for its step in progress to end
      + num_prefill_tokens_i                   # prompt tokens it has yet to compute (ReplicaLoad)
      + prompt_tokens - block_size * matched_i # what this prompt would add: its uncached part
      + decode_weight * num_running_i          # its decode batch, which every step carries

    ``matched_i``: the request's prompt block hashes (``routers.hashing``), walked from the first,
    until the first one replica ``i`` does not hold, as the prefix cache itself would hit. A
    replica without the prompt pays for prefilling it, so it takes a hot application's request
    only once the holder's queue outweighs that prefill; where every replica holds the prompt the
    prefix term is the same for all and the router balances queued work. ``decode_weight`` (5):
    the step time one decoding sequence adds, in prompt tokens (about 5 for the twin's Llama-3-8B
    on an H100).

    A request joins a replica's next step, so it first waits for the step in progress to end
    (``ReplicaLoad.step_left_s``: the last step's duration less the time this one has run). With
    every prompt held everywhere that wait is most of what differs between replicas (it spans
    a whole step, where a decode batch's spread changes a step by a few percent): a front that
    ignores it can only tie round robin. ``prefill_tokens_per_s`` (50,000) turns it into prompt
    tokens: the prefill throughput, about 0.02 ms a token for that model and GPU (0 ignores the
    wait). The lowest cost wins; ties go round robin (the first replica at or after the one
    after the last chosen), so equal replicas get the even spacing of round robin rather than
    the lowest index. The defaults of both constants are Llama-3-8B's on an H100; the twin and
    ``validate`` read them off their step-time model (``simulator.router_prices``)."""

    __slots__ = ("block_size", "max_blocks", "decode_weight", "prefill_tokens_per_s", "_young",
                 "_old", "_young_cap", "_next", "_walks", "_readers")

    uses_kv_events = True  # constants of the class: the backend turns the replicas' events on
    reads_kv_usage = False

    def __init__(self, block_size: int, max_blocks: int = 1 << 18,
                 decode_weight: float = 5.0, prefill_tokens_per_s: float = 50_000.0) -> None:
        for name, value in (("block_size", block_size), ("max_blocks", max_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        for name, weight in (("decode_weight", decode_weight),
                             ("prefill_tokens_per_s", prefill_tokens_per_s)):
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                    or not 0 <= weight < float("inf"):
                raise ValueError(f"{name} must be a non-negative number, got {weight!r}.")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.decode_weight = float(decode_weight)
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        # block hash -> bitmask of the replicas holding it (never 0), in two generations: the
        # young one stays below ``_young_cap`` hashes and the old one at most that, so the two
        # hold at most ``max_blocks``.
        self._young: dict[int, int] = {}
        self._old: dict[int, int] = {}
        self._young_cap = (max_blocks + 1) // 2
        self._next = 0  # where the next tie's rotation starts
        # Walks kept while the masks they read stay as they were, by first hash (``_walk``), and
        # the first hash of the walk that read each hash. Both bounded.
        self._walks: dict[int, _Walk] = {}
        self._readers: dict[int, int] = {}

    def __len__(self) -> int:
        """The block hashes indexed (at most ``max_blocks``)."""
        return len(self._young) + len(self._old)

    def holders(self, block_hash: int) -> list[int]:
        """The replicas the index says hold ``block_hash``."""
        return _bits(self._mask(block_hash))

    def _mask(self, block_hash: int) -> int:
        """The replicas holding ``block_hash``, as a bitmask, in either generation."""
        return self._young.get(block_hash) or self._old.get(block_hash, 0)

    def route(self, request: Request, replicas: Sequence[ReplicaLoad]) -> int:
        up = healthy(replicas)
        matched = self.matched_blocks(request, up)
        prompt, bs, per_decode = request.num_prompt_tokens, self.block_size, self.decode_weight
        per_s = self.prefill_tokens_per_s
        n, start = len(replicas), self._next
        best, best_cost, best_turn = up[0], _INF, n
        for i in up:
            load = replicas[i]
            elapsed, last = load.step_elapsed_s, load.last_step_s  # (``step_left_s``, inlined)
            left = 0.0 if elapsed is None or elapsed >= last else last - elapsed
            cost = (per_s * left + load.num_prefill_tokens + prompt - bs * matched[i]
                    + per_decode * load.num_running)
            if cost <= best_cost:  # the lowest (cost, turn after the last chosen)
                turn = (i - start) % n
                if cost < best_cost or turn < best_turn:
                    best, best_cost, best_turn = i, cost, turn
        self._next = best + 1
        return best

    def matched_blocks(self, request: Request, among: Sequence[int]) -> dict[int, int]:
        """For each replica in ``among``: how many of the prompt's blocks, from the first, it
        holds (by the index). The hashes matched in the old generation move up to the young.

        Requests of one application walk the same system prompt, so a walk is kept (by its
        first hash) until a mask it read changes (a change of its first miss only opens its
        end): a later prompt whose hash at the walk's depth is the walk's shares every block
        before it (a hash covers its whole prefix) and reads its matches off the walk, going on
        hash by hash only past it.
        ``_matched_blocks_plain`` is the hash-by-hash loop it stands for."""
        hashes = prompt_block_hashes(request, self.block_size)
        if not isinstance(hashes, list):  # a chain made as it is read: the plain loop
            return self._matched_blocks_plain(request, among)
        if not hashes:
            return dict.fromkeys(among, 0)
        walk = self._walks.get(hashes[0])
        if walk is None or not walk.covers(hashes):
            walk = self._walk(hashes)
        depth, ends = walk.depth, walk.ends
        short = len(hashes) if len(hashes) < depth else depth
        get = ends.get
        matched = {i: e if (e := get(i, 0)) < short else short for i in among}
        if short == depth and walk.continues(hashes):  # replicas that held all of the walk
            alive = 0
            for i in among:
                if depth and matched[i] == depth:
                    alive |= 1 << i
            # (where none of them holds the next block, each one's match is the walk's)
            if alive and self._mask(hashes[depth]) & alive:
                self._go_on(hashes, depth, alive, matched)
        if self._old:
            self._promote(hashes[:max(matched.values(), default=0)])
        return matched

    def _walk(self, hashes: list[int]) -> _Walk:
        """The walk of ``hashes`` for every replica holding the first, kept by its first hash."""
        ends: dict[int, int] = {}
        depth = self._go_on(hashes, 0, self._mask(hashes[0]), ends)
        walks, readers, first = self._walks, self._readers, hashes[0]
        if len(walks) >= _MAX_WALKS or len(readers) >= _MAX_READERS:
            walks.clear()  # (a walk is kept only while every hash it read has its reader)
            readers.clear()
        readers.update(dict.fromkeys(hashes[:depth + 1], first))  # (its first miss included)
        walk = walks[first] = _Walk(hashes, depth, ends)
        return walk

    def _go_on(self, hashes: list[int], depth: int, alive: int, matched: dict[int, int]) -> int:
        """The plain loop from block ``depth`` on, for the replicas in ``alive`` (without
        promoting): each one's match into ``matched``; returns the first block none holds."""
        get = self._mask if self._old else self._young.get
        for block_hash in hashes[depth:] if depth else hashes:
            holding = (get(block_hash) or 0) & alive
            if holding != alive:
                for i in _bits(alive & ~holding):
                    matched[i] = depth
                alive = holding
                if not alive:
                    return depth
            depth += 1
        for i in _bits(alive):
            matched[i] = depth
        return depth

    def _promote(self, block_hashes: Sequence[int]) -> None:
        """Moves those of ``block_hashes`` in the old generation up to the young one, in order,
        while the young one has room (a match never forgets a generation)."""
        young, old, cap = self._young, self._old, self._young_cap - 1
        for block_hash in block_hashes:
            if len(young) >= cap:
                return
            mask = old.pop(block_hash, 0)
            if mask:
                young[block_hash] = mask

    def _matched_blocks_plain(self, request: Request, among: Sequence[int]) -> dict[int, int]:
        """``matched_blocks`` hash by hash, promoting as it goes (the reference)."""
        alive = 0
        for i in among:
            alive |= 1 << i
        matched = dict.fromkeys(among, 0)
        depth = 0
        for block_hash in prompt_block_hashes(request, self.block_size):
            holding = self._mask(block_hash) & alive
            if holding != alive:  # some replicas' matches end here
                for i in _bits(alive & ~holding):
                    matched[i] = depth
                alive = holding
                if not alive:
                    return matched
            self._promote((block_hash,))
            depth += 1
        for i in _bits(alive):
            matched[i] = depth
        return matched

    def on_kv_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        if not events:
            return
        bit, readers = 1 << replica, self._readers
        for event in events:
            if isinstance(event, BlockStored):
                if not readers.keys().isdisjoint(event.block_hashes):
                    self._forget(event.block_hashes)
                self._store(event.block_hashes, bit)
            elif isinstance(event, BlockRemoved):
                if not readers.keys().isdisjoint(event.block_hashes):
                    self._forget(event.block_hashes)
                self._remove(event.block_hashes, bit)
            elif isinstance(event, AllBlocksCleared):
                self.on_replica_reset(replica)
            else:
                raise ValueError(f"events: not a KV cache event: {event!r}")

    def _store(self, block_hashes: Sequence[int], bit: int) -> None:
        """Sets ``bit`` on these hashes, in the young generation; a new one that fills it makes
        it the old one (the old one forgotten)."""
        young, old, cap = self._young, self._old, self._young_cap
        for block_hash in block_hashes:
            mask = young.get(block_hash)
            if mask is not None:
                young[block_hash] = mask | bit
                continue
            young[block_hash] = old.pop(block_hash, 0) | bit if old else bit
            if len(young) >= cap:
                self._changing()  # (the old generation's masks go: every walk read them)
                self._old, self._young = young, {}
                young, old = self._young, self._old

    def _remove(self, block_hashes: Sequence[int], bit: int) -> None:
        """Clears ``bit`` on these hashes; a hash no replica holds leaves the index."""
        young, old = self._young, self._old
        for block_hash in block_hashes:
            where = young
            mask = young.get(block_hash)
            if mask is None:
                where, mask = old, old.get(block_hash)
                if mask is None:
                    continue
            mask &= ~bit
            if mask:
                where[block_hash] = mask
            else:
                del where[block_hash]

    def on_replica_reset(self, replica: int) -> None:
        self._changing()
        keep = ~(1 << replica)
        for index in (self._young, self._old):
            for block_hash in list(index):
                mask = index[block_hash] & keep
                if mask:
                    index[block_hash] = mask
                else:
                    del index[block_hash]

    def _forget(self, block_hashes: Sequence[int]) -> None:
        """Before these hashes' masks change: the kept walks that read them are dropped, but for
        a walk's first miss (a prompt's first block of its own, stored as that prompt is
        prefilled), after which the walk only stops trusting it (``_Walk.open_end``): the masks
        of its blocks before it are as they were."""
        pop, walks = self._readers.pop, self._walks
        for block_hash in block_hashes:
            first = pop(block_hash, None)
            if first is None:
                continue
            walk = walks.get(first)
            if walk is not None and walk.depth < len(walk.hashes) \
                    and walk.hashes[walk.depth] == block_hash:
                walk.open_end = True
            else:
                walks.pop(first, None)

    def _changing(self) -> None:
        """Before the whole index changes: every walk dropped."""
        self._walks.clear()
        self._readers.clear()


@dataclass(slots=True)
class _Walk:
    """A prompt's walk of the index: ``depth`` blocks, from the first, held by some replica that
    holds the first; ``ends``: each such replica's matched blocks."""

    hashes: list[int]
    depth: int
    ends: dict[int, int]
    # Its first miss, ``hashes[depth]``, may have been stored since: a prompt going on past the
    # walk is then read on from there, whatever its block there.
    open_end: bool = False

    def covers(self, hashes: list[int]) -> bool:
        """Whether ``hashes`` share the walk's blocks up to its depth (or to their end)."""
        short = min(len(hashes), self.depth)
        return not short or hashes[short - 1] == self.hashes[short - 1]

    def continues(self, hashes: list[int]) -> bool:
        """Whether ``hashes`` (sharing the walk's blocks) go on past it with a block the walk
        did not read, or did before it may have changed."""
        depth, mine = self.depth, self.hashes
        return len(hashes) > depth and (self.open_end or len(mine) == depth
                                        or hashes[depth] != mine[depth])


def _bits(mask: int) -> list[int]:
    """The positions of the set bits of ``mask``, lowest first."""
    return [i for i in range(mask.bit_length()) if mask >> i & 1]
