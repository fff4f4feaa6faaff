"""Routing arrivals across replicas of the simulated engine (cluster studies)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from twinserve.core.request import Request
from twinserve.core.scheduler import Scheduler

ROUTERS = ("round-robin", "least-outstanding", "prefix-affinity")


class Router(Protocol):
    def route(self, request: Request, replicas: Sequence[Scheduler]) -> int: ...


class RoundRobinRouter:
    def __init__(self) -> None:
        self._next = 0

    def route(self, request: Request, replicas: Sequence[Scheduler]) -> int:
        index = self._next % len(replicas)
        self._next += 1
        return index


def _outstanding(s: Scheduler) -> int:
    return len(s.running) + s.num_waiting


class LeastOutstandingRouter:
    """The replica with the fewest running + waiting requests (lowest index on ties)."""

    def route(self, request: Request, replicas: Sequence[Scheduler]) -> int:
        return min(range(len(replicas)), key=lambda i: _outstanding(replicas[i]))


class PrefixAffinityRouter:
    """Requests whose first ``prefix_tokens`` tokens match go to the same replica, so its prefix
    cache sees them all, unless that replica has ``max_imbalance`` more outstanding requests than
    the least loaded one; then the least loaded takes it (and the prefix moves there)."""

    def __init__(self, prefix_tokens: int = 64, max_imbalance: int = 32) -> None:
        self.prefix_tokens = prefix_tokens
        self.max_imbalance = max_imbalance
        self._home: dict[tuple[int, ...], int] = {}
        self._least = LeastOutstandingRouter()

    def route(self, request: Request, replicas: Sequence[Scheduler]) -> int:
        key = tuple(request.prompt_token_ids[:self.prefix_tokens])
        least = self._least.route(request, replicas)
        home = self._home.get(key)
        if home is None or (_outstanding(replicas[home]) - _outstanding(replicas[least])
                            > self.max_imbalance):
            home = self._home[key] = least
        return home


def make_router(name: str) -> Router:
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "least-outstanding":
        return LeastOutstandingRouter()
    if name == "prefix-affinity":
        return PrefixAffinityRouter()
    raise ValueError(f"unknown router {name!r}; valid: {', '.join(ROUTERS)}")
