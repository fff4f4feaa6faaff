"""Routers by name: the built-in ones, plus third-party routers from the entry-point group
``twinserve.routers`` (``name = "package.module:RouterClass"``). One package for the twin and the
data-parallel front: both route through the objects ``make_router`` returns."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from twinserve.routers.cache_aware import CacheAwareRouter
from twinserve.routers.least_outstanding import LeastOutstandingRouter
from twinserve.routers.prefix_affinity import PrefixAffinityRouter
from twinserve.routers.round_robin import RoundRobinRouter
from twinserve.routers.router import (
    NoHealthyReplica,
    ReplicaLoad,
    Router,
    reads_kv_usage,
    reads_loads,
    uses_kv_events,
)

ENTRY_POINT_GROUP = "twinserve.routers"

# A read-only table of the built-in classes (each caller builds its own router instance).
_BUILTIN: dict[str, type] = {
    "round-robin": RoundRobinRouter,
    "least-outstanding": LeastOutstandingRouter,
    "prefix-affinity": PrefixAffinityRouter,
    "cache-aware": CacheAwareRouter,
}
ROUTERS: tuple[str, ...] = tuple(_BUILTIN)

__all__ = ["ROUTERS", "ENTRY_POINT_GROUP", "CacheAwareRouter", "LeastOutstandingRouter",
           "NoHealthyReplica", "PrefixAffinityRouter", "ReplicaLoad", "RoundRobinRouter", "Router",
           "available_routers", "make_router", "reads_kv_usage", "reads_loads", "router_class",
           "uses_kv_events"]


def available_routers() -> dict[str, type]:
    """Built-in routers and those installed through the entry-point group (a built-in name wins)."""
    found = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in found:
            found[ep.name] = ep.load()
    return found


def router_class(name: str) -> type:
    """The built-in or installed router class named ``name``; ValueError naming it otherwise
    (also where one replica routes nothing: a misspelt name is refused, not dropped)."""
    cls = _BUILTIN.get(name)
    if cls is None:
        routers = available_routers()
        cls = routers.get(name)
        if cls is None:
            raise ValueError(f"unknown router {name!r}; valid: {', '.join(routers)}")
    return cls


def make_router(name: str, block_size: int, prices: Mapping[str, float] | None = None,
                **options: Any) -> Router:
    """A fresh router. ``block_size`` (the replicas' KV block size) reaches the routers whose
    constructor takes one, and each of ``prices`` (constants of the hardware at hand, as
    ``simulator.router_prices`` reads them off a step-time model) the routers whose constructor
    has a parameter of its name; ``options`` win over both. Unknown names and bad options raise
    ValueError."""
    cls = router_class(name)
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # not a class with a readable signature
        raise ValueError(f"router {name!r} is not a router class: {cls!r}") from None
    offered = {"block_size": block_size, **(prices or {})}
    options = {**{k: v for k, v in offered.items() if k in parameters}, **options}
    try:
        router = cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for router {name!r}: {exc}") from None
    if not isinstance(router, Router):
        raise ValueError(f"router {name!r} lacks route, on_kv_events or on_replica_reset")
    return router
