"""Requests that share their first tokens go to one replica, with a bounded table of homes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from twinserve.core.kv_events import KVCacheEvent
from twinserve.core.request import LazyPrompt, Request
from twinserve.routers.router import ReplicaLoad, healthy, least_outstanding


class PrefixAffinityRouter:
    """Requests whose first ``prefix_tokens`` tokens match go to the same replica (their home), so
    its prefix cache sees them all, unless the home has ``max_imbalance`` more outstanding requests
    than the least loaded replica, or is unhealthy; then the least loaded takes the request and
    becomes the home. The homes are an LRU table of at most ``max_prefixes`` entries: the prefix
    used least recently is forgotten first (its next request then goes to the least loaded).

    A prompt's first tokens are keyed by their ids, or, for a twin's ``LazyPrompt`` whose
    blocks divide them, by the key of the block they end with: equal exactly where the ids
    are (the prompt's promise), without making the ids. A run's prompts are all of one kind,
    so its requests share homes as with the ids."""

    __slots__ = ("prefix_tokens", "max_imbalance", "max_prefixes", "_home")
    reads_kv_usage = False  # a constant of the class: it reads the request counts only

    def __init__(self, prefix_tokens: int = 64, max_imbalance: int = 32,
                 max_prefixes: int = 65536) -> None:
        for name, value in (("prefix_tokens", prefix_tokens), ("max_prefixes", max_prefixes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if isinstance(max_imbalance, bool) or not isinstance(max_imbalance, int) or max_imbalance < 0:
            raise ValueError(f"max_imbalance must be a non-negative integer, got {max_imbalance!r}.")
        self.prefix_tokens = prefix_tokens
        self.max_imbalance = max_imbalance
        self.max_prefixes = max_prefixes
        self._home: OrderedDict[int | tuple[int, ...], int] = OrderedDict()

    def __len__(self) -> int:
        """The prefixes remembered (at most ``max_prefixes``)."""
        return len(self._home)

    def route(self, request: Request, replicas: Sequence[ReplicaLoad]) -> int:
        up = healthy(replicas)
        key = self._key(request)
        least = least_outstanding(replicas, up)
        home = self._home.get(key)
        if home is None or not replicas[home].healthy or (
                replicas[home].outstanding - replicas[least].outstanding > self.max_imbalance):
            home = least
        self._home[key] = home
        self._home.move_to_end(key)
        if len(self._home) > self.max_prefixes:
            self._home.popitem(last=False)
        return home

    def _key(self, request: Request) -> int | tuple[int, ...]:
        """The key of the prompt's first ``prefix_tokens`` tokens."""
        prompt, n = request.prompt_token_ids, self.prefix_tokens
        if type(prompt) is LazyPrompt and len(prompt) >= n and not n % prompt.key_block_size:
            return prompt.keys[n // prompt.key_block_size - 1]
        return tuple(prompt[:n])

    def on_kv_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        pass

    def on_replica_reset(self, replica: int) -> None:
        for key in [k for k, home in self._home.items() if home == replica]:
            del self._home[key]
