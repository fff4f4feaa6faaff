"""The cache-aware router: prefix blocks each replica holds (from its KV events) against load."""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import accumulate, islice, repeat, takewhile, tee
from operator import and_

from twinserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from twinserve.core.request import Request
from twinserve.routers.hashing import prompt_block_hashes
from twinserve.routers.router import ReplicaLoad, healthy

_INF = float("inf")


class CacheAwareRouter:
    """Sends each request to the healthy replica where its first token would come soonest: the
    prompt blocks a replica already holds (llm-d's precise prefix-cache scorer) priced together
    with the work ahead of it there, in one unit, prompt tokens.

    What a replica holds comes only from its own KV events (``core.kv_events``): one LRU index,
    block hash -> the replicas holding it (a bit each), of at most ``max_blocks`` hashes. A hash
    stored or matched is moved to the young end; past the cap the oldest is forgotten, which can
    only make a replica look emptier than it is.

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

    __slots__ = ("block_size", "max_blocks", "decode_weight", "prefill_tokens_per_s", "_index",
                 "_next")

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
        self._index: OrderedDict[int, int] = OrderedDict()  # block hash -> bitmask of replicas
        self._next = 0  # where the next tie's rotation starts

    def __len__(self) -> int:
        """The block hashes indexed (at most ``max_blocks``)."""
        return len(self._index)

    def holders(self, block_hash: int) -> list[int]:
        """The replicas the index says hold ``block_hash``."""
        mask = self._index.get(block_hash, 0)
        return [i for i in range(mask.bit_length()) if mask >> i & 1]

    def route(self, request: Request, replicas: Sequence[ReplicaLoad]) -> int:
        up = healthy(replicas)
        matched = self.matched_blocks(request, up)
        prompt, bs, per_decode = len(request.prompt_token_ids), self.block_size, self.decode_weight
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
        holds (by the index). The hashes matched move to the young end of the LRU.

        One walk of the index in C (``_matched_blocks_plain`` is the loop it replaces): the
        running AND of the prompt's masks, from the replicas in ``among``, kept while any
        replica still matches. That sequence only loses bits, so each replica's match ends
        where its bit goes, found by bisection; a prompt whose first block no replica holds
        stops at once."""
        alive = 0
        for i in among:
            alive |= 1 << i
        hashes = prompt_block_hashes(request, self.block_size)
        walked = hashes if isinstance(hashes, list) else None
        if walked is None:  # (a chain made as it is read: keep what the walk read)
            hashes, walked_iter = tee(hashes)
        held = list(takewhile(bool, accumulate(map(self._index.get, hashes, repeat(0)), and_,
                                               initial=alive)))
        depth = len(held) - 1  # blocks some replica in ``among`` holds, from the first
        if depth:
            touched = walked[:depth] if walked is not None else islice(walked_iter, depth)
            deque(map(self._index.move_to_end, touched), maxlen=0)
        last = held[-1]
        matched = {}
        for i in among:
            bit = 1 << i
            matched[i] = depth if last & bit else bisect_left(
                held, True, key=lambda mask: not mask & bit) - 1
        return matched

    def _matched_blocks_plain(self, request: Request, among: Sequence[int]) -> dict[int, int]:
        """``matched_blocks`` as a plain loop, hash by hash (the reference; it touches the LRU
        alike)."""
        get, touch = self._index.get, self._index.move_to_end
        alive = 0
        for i in among:
            alive |= 1 << i
        matched = dict.fromkeys(among, 0)
        depth = 0
        for block_hash in prompt_block_hashes(request, self.block_size):
            holding = get(block_hash, 0) & alive
            if holding != alive:  # some replicas' matches end here
                for i in _bits(alive & ~holding):
                    matched[i] = depth
                alive = holding
                if not alive:
                    return matched
            touch(block_hash)
            depth += 1
        for i in _bits(alive):
            matched[i] = depth
        return matched

    def on_kv_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        bit = 1 << replica
        index = self._index
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    index[block_hash] = index.get(block_hash, 0) | bit
                    index.move_to_end(block_hash)
                while len(index) > self.max_blocks:
                    index.popitem(last=False)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    mask = index.get(block_hash, 0) & ~bit
                    if mask:
                        index[block_hash] = mask
                    else:
                        index.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                self.on_replica_reset(replica)
            else:
                raise ValueError(f"events: not a KV cache event: {event!r}")

    def on_replica_reset(self, replica: int) -> None:
        keep = ~(1 << replica)
        index = self._index
        for block_hash in list(index):
            mask = index[block_hash] & keep
            if mask:
                index[block_hash] = mask
            else:
                del index[block_hash]


def _bits(mask: int) -> list[int]:
    """The positions of the set bits of ``mask``, lowest first."""
    return [i for i in range(mask.bit_length()) if mask >> i & 1]
