"""The router seam: which replica serves a request, seen only through what a real front knows.

The twin (``simulator/``) and the data-parallel front (``entrypoints/``) import these same objects:
a router reads one ``ReplicaLoad`` per replica, refreshed before each ``route``, and the block-hash
events each replica's KV manager emits (``core.kv_events``), never a scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from twinserve.core.kv_events import KVCacheEvent
from twinserve.core.request import Request

_INF = float("inf")


class NoHealthyReplica(RuntimeError):
    """Every replica is marked unhealthy: the request cannot be routed."""


@dataclass(slots=True)
class ReplicaLoad:
    """What a router may read about one replica, refreshed before each ``route()``."""

    num_running: int
    num_waiting: int
    kv_usage: float  # 0..1
    healthy: bool = True  # a dead or restarting replica: never chosen
    # Prompt tokens it has yet to compute (``SchedulerStats.num_prefill_tokens``): the work
    # queued ahead of a new request's prefill.
    num_prefill_tokens: int = 0
    # Seconds its step in progress has run (None: no step in progress), and how long its last
    # finished step took (0.0 before any): a request routed to it waits for that step's end.
    step_elapsed_s: float | None = None
    last_step_s: float = 0.0

    def __post_init__(self) -> None:
        # (one test for the common case: a twin builds one per replica and arrival)
        running, waiting, prefill = counts = (self.num_running, self.num_waiting,
                                              self.num_prefill_tokens)
        if not (type(running) is int and type(waiting) is int and type(prefill) is int
                and running >= 0 and waiting >= 0 and prefill >= 0):
            for name, value in zip(("num_running", "num_waiting", "num_prefill_tokens"), counts):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be within [0, 1], got {self.kv_usage!r}.")
        if not 0.0 <= self.last_step_s < _INF:
            raise ValueError(f"last_step_s must be a non-negative number, got {self.last_step_s!r}.")
        if self.step_elapsed_s is not None and not 0.0 <= self.step_elapsed_s < _INF:
            raise ValueError(f"step_elapsed_s must be None or a non-negative number, got "
                             f"{self.step_elapsed_s!r}.")

    @property
    def outstanding(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def step_left_s(self) -> float:
        """How long its step in progress has left, if it takes as long as the last one did
        (0.0 without a step in progress, or one already past that)."""
        elapsed = self.step_elapsed_s
        return 0.0 if elapsed is None or elapsed >= self.last_step_s else self.last_step_s - elapsed


@runtime_checkable
class Router(Protocol):
    def route(self, request: Request, replicas: Sequence[ReplicaLoad]) -> int:
        """The index of the replica for ``request``; raises ``NoHealthyReplica`` when none is.
        ``replicas`` may be the caller's objects, refreshed in place before the next call (the
        twin's are): read them here, never keep them."""
        ...

    def on_kv_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        """The replica's own block-hash events, in order; routers that ignore them do nothing."""
        ...

    def on_replica_reset(self, replica: int) -> None:
        """The replica died or restarted: forget what it held."""
        ...


def uses_kv_events(router: Router) -> bool:
    """Whether the router reads KV events (its ``uses_kv_events`` attribute; False without one):
    a backend turns the replicas' events on only then, since recording them costs a little."""
    return bool(getattr(router, "uses_kv_events", False))


def reads_loads(router: Router) -> bool:
    """Whether the router reads the replicas' loads or KV events at all (its ``reads_loads``
    attribute; True without one). They change within a twin's run of decode steps (requests
    finish, blocks are taken), so the twin's fleet fast path takes in the step an arrival comes
    during only for a router that reads none (round robin)."""
    return bool(getattr(router, "reads_loads", True))


def reads_kv_usage(router: Router) -> bool:
    """Whether the router reads ``ReplicaLoad.kv_usage`` (its ``reads_kv_usage`` attribute;
    True without one). The twin leaves it at 0.0 for one that does not: a replica's usage in a
    decode run in progress costs it a walk of the blocks the run's ends free."""
    return bool(getattr(router, "reads_kv_usage", True))


def healthy(replicas: Sequence[ReplicaLoad]) -> list[int]:
    """The indices of the healthy replicas; raises ``NoHealthyReplica`` when there is none."""
    found = [i for i, r in enumerate(replicas) if r.healthy]
    if not found:
        raise NoHealthyReplica(f"none of the {len(replicas)} replicas is healthy")
    return found


def least_outstanding(replicas: Sequence[ReplicaLoad], among: Sequence[int]) -> int:
    """The replica in ``among`` with the fewest running + waiting requests (lowest index on ties)."""
    best, fewest = among[0], None  # (``outstanding``, inlined: a fleet's twin asks every arrival)
    for i in among:
        load = replicas[i]
        n = load.num_running + load.num_waiting
        if fewest is None or n < fewest:
            best, fewest = i, n
    return best
