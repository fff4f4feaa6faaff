"""The least loaded healthy replica, by running + waiting requests."""

from __future__ import annotations

from collections.abc import Sequence

from twinserve.core.kv_events import KVCacheEvent
from twinserve.core.request import Request
from twinserve.routers.router import ReplicaLoad, healthy, least_outstanding


class LeastOutstandingRouter:
    """The healthy replica with the fewest running + waiting requests (lowest index on ties)."""

    __slots__ = ()
    reads_kv_usage = False  # a constant of the class: it reads the request counts only

    def route(self, request: Request, replicas: Sequence[ReplicaLoad]) -> int:
        return least_outstanding(replicas, healthy(replicas))

    def on_kv_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        pass

    def on_replica_reset(self, replica: int) -> None:
        pass
