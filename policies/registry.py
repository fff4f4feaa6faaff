"""Policies by name: a decorator registry, plus third-party policies from the entry-point group
``twinserve.policies`` (``name = "package.module:PolicyClass"``)."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

from twinserve.core.policy import SchedulingPolicy

ENTRY_POINT_GROUP = "twinserve.policies"
P = TypeVar("P", bound=type[SchedulingPolicy])

# Filled only by the @register decorators below at import time: a read-only table of the built-in
# classes, never of policy instances (each engine builds its own instance).
_BUILTIN: dict[str, type[SchedulingPolicy]] = {}


def register(name: str) -> Callable[[P], P]:
    def wrap(cls: P) -> P:
        if name in _BUILTIN:
            raise ValueError(f"policy {name!r} is registered twice")
        cls.name = name
        _BUILTIN[name] = cls
        return cls
    return wrap


def available_policies() -> dict[str, type[SchedulingPolicy]]:
    """Built-in policies and those installed through the entry-point group."""
    found = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in found:
            found[ep.name] = ep.load()
    return found


def get_policy(name: str, **options: Any) -> SchedulingPolicy:
    """A fresh policy instance. Unknown names raise ValueError listing the valid ones."""
    # a built-in name wins over an entry point's anyway: only other names scan the entry points
    cls: Any = _BUILTIN.get(name)
    if cls is None:
        policies = available_policies()
        cls = policies.get(name)
        if cls is None:
            raise ValueError(f"unknown scheduling_policy {name!r}; valid: "
                             f"{', '.join(sorted(policies))}")
    if not (isinstance(cls, type) and issubclass(cls, SchedulingPolicy)):
        raise ValueError(f"policy {name!r} does not subclass twinserve.core.policy.SchedulingPolicy")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for policy {name!r}: {exc}") from None
