"""The cache-aware router: prefix blocks each replica holds (from its KV events) against load."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from twinserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from twinserve.core.request import Request
from twinserve.routers.hashing import prompt_block_hashes
from twinserve.routers.router import ReplicaLoad, healthy


class CacheAwareRouter:
    """Scores each healthy replica by the prompt blocks it already holds and by its load, as
    llm-d's precise prefix-cache scorer plus its queue and KV-utilisation scorers do.

    What a replica holds comes only from its own KV events (``core.kv_events``): one LRU index,
    block hash -> the replicas holding it (a bit each), of at most ``max_blocks`` hashes. A hash
    stored or matched is moved to the young end; past the cap the oldest is forgotten, which can
    only make a replica look emptier than it is.

    The score of replica ``i``::

        prefix_weight * matched_i / prompt_blocks       # the precise prefix scorer, in [0, 1]
      - queue_weight  * (q_i - min_q) / queue_span      # the queue scorer, q = running + waiting
      + kv_weight     * (1 - kv_usage_i)                # the KV-utilisation scorer, in [0, 1]

    ``matched_i``: the request's prompt block hashes (``routers.hashing``), walked from the first,
    until the first one replica ``i`` does not hold, as the prefix cache itself would hit. The
    queue term counts the requests a replica has beyond the emptiest healthy one: every
    ``queue_span`` of them cost ``queue_weight``, without bound, so a long enough queue outweighs
    any prefix (llm-d normalises it to [0, 1], which lets a hot prefix pile requests onto one
    replica). The highest score wins; ties go to the fewest running + waiting requests, then to
    the lowest index. A prompt shorter than a block scores on load alone.

    A replica holding a long prefix keeps its application's requests while its queue is within
    about ``queue_span * prefix_weight / queue_weight`` requests of the emptiest; past that the
    load moves a hot application onto a second replica, whose events then let it share the
    traffic."""

    __slots__ = ("block_size", "max_blocks", "prefix_weight", "queue_weight", "queue_span",
                 "kv_weight", "_index")

    uses_kv_events = True  # a constant of the class: the backend turns the replicas' events on

    def __init__(self, block_size: int, max_blocks: int = 1 << 18, prefix_weight: float = 2.0,
                 queue_weight: float = 1.0, queue_span: float = 8.0,
                 kv_weight: float = 0.5) -> None:
        for name, value in (("block_size", block_size), ("max_blocks", max_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        for name, weight in (("prefix_weight", prefix_weight), ("queue_weight", queue_weight),
                             ("kv_weight", kv_weight)):
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
                raise ValueError(f"{name} must be a non-negative number, got {weight!r}.")
        if isinstance(queue_span, bool) or not isinstance(queue_span, (int, float)) \
                or not queue_span > 0:
            raise ValueError(f"queue_span must be a positive number, got {queue_span!r}.")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.prefix_weight = float(prefix_weight)
        self.queue_weight = float(queue_weight)
        self.queue_span = float(queue_span)
        self.kv_weight = float(kv_weight)
        self._index: OrderedDict[int, int] = OrderedDict()  # block hash -> bitmask of replicas

    def __len__(self) -> int:
        """The block hashes indexed (at most ``max_blocks``)."""
        return len(self._index)

    def holders(self, block_hash: int) -> list[int]:
        """The replicas the index says hold ``block_hash``."""
        mask = self._index.get(block_hash, 0)
        return [i for i in range(mask.bit_length()) if mask >> i & 1]

    def route(self, request: Request, replicas: Sequence[ReplicaLoad]) -> int:
        up = healthy(replicas)
        num_blocks = len(request.prompt_token_ids) // self.block_size
        matched = self.matched_blocks(request, up)
        queues = [replicas[i].outstanding for i in up]
        low = min(queues)
        per_request = self.queue_weight / self.queue_span
        best, best_key = up[0], None
        for i, q in zip(up, queues):
            score = (self.prefix_weight * matched[i] / num_blocks if num_blocks else 0.0) \
                - per_request * (q - low) + self.kv_weight * (1.0 - replicas[i].kv_usage)
            key = (-score, q, i)
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    def matched_blocks(self, request: Request, among: Sequence[int]) -> dict[int, int]:
        """For each replica in ``among``: how many of the prompt's blocks, from the first, it
        holds (by the index). The hashes matched move to the young end of the LRU."""
        index = self._index
        alive = 0
        for i in among:
            alive |= 1 << i
        matched = dict.fromkeys(among, 0)
        depth = 0
        for block_hash in prompt_block_hashes(request, self.block_size):
            holding = index.get(block_hash, 0) & alive
            for i in _bits(alive & ~holding):
                matched[i] = depth
            alive = holding
            if not alive:
                return matched
            index.move_to_end(block_hash)
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
