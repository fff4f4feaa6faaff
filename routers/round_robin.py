"""Round robin over the healthy replicas."""

from __future__ import annotations

from collections.abc import Sequence

from twinserve.core.kv_events import KVCacheEvent
from twinserve.core.request import Request
from twinserve.routers.router import ReplicaLoad, healthy


class RoundRobinRouter:
    """Each request to the next replica in turn; an unhealthy replica's turn passes to the next."""

    __slots__ = ("_next",)
    reads_loads = False  # a constant of the class: it reads nothing of the replicas

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: Request, replicas: Sequence[ReplicaLoad]) -> int:
        up = healthy(replicas)
        start = self._next % len(replicas)
        index = next((i for i in up if i >= start), up[0])
        self._next = index + 1
        return index

    def on_kv_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        pass

    def on_replica_reset(self, replica: int) -> None:
        pass
