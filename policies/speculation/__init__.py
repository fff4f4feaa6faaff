"""Speculation policies by name: how many drafts each running decode gets, step by step.

Built-ins: ``fixed`` (always k_max, vLLM's behaviour) and ``adaptive`` (the self-tuning one, the
default). Third-party policies load through the entry-point group
``twinserve.speculation_policies`` (``name = "package.module:PolicyClass"``); a policy class is
built as ``cls(k_max, **options)`` and must satisfy ``core.speculation.SpeculationPolicy``.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from twinserve.core.speculation import SpeculationPolicy
from twinserve.core.speculative_config import SpeculativeConfig
from twinserve.policies.speculation.adaptive import AdaptiveSpeculation
from twinserve.policies.speculation.fixed import FixedSpeculation

ENTRY_POINT_GROUP = "twinserve.speculation_policies"
# A read-only table of the built-in classes (each engine builds its own instance).
_BUILTIN: dict[str, type] = {"fixed": FixedSpeculation, "adaptive": AdaptiveSpeculation}


def available_speculation_policies() -> dict[str, type]:
    """Built-in policies and those installed through the entry-point group."""
    found = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in found:
            found[ep.name] = ep.load()
    return found


def get_speculation_policy(name: str, k_max: int, **options: Any) -> SpeculationPolicy:
    """A fresh policy instance. Unknown names and bad options raise ValueError naming them."""
    cls = _BUILTIN.get(name)
    if cls is None:
        policies = available_speculation_policies()
        cls = policies.get(name)
        if cls is None:
            raise ValueError(f"unknown speculation policy {name!r}; valid: "
                             f"{', '.join(sorted(policies))}")
    try:
        policy = cls(k_max, **options)
    except TypeError as exc:
        raise ValueError(f"bad options for speculation policy {name!r}: {exc}") from None
    if not isinstance(policy, SpeculationPolicy):
        raise ValueError(f"speculation policy {name!r} does not implement "
                         "twinserve.core.speculation.SpeculationPolicy")
    return policy


def speculation_policy_for(config: SpeculativeConfig | None) -> SpeculationPolicy | None:
    """The policy a ``SpeculativeConfig`` names (None: speculation off), built with the
    configured k, ``disable_by_batch_size`` and, when set, ``max_num_speculative_tokens``
    (passed only then: a plugin that cannot raise k need not take it)."""
    if config is None:
        return None
    options: dict[str, Any] = {"disable_by_batch_size": config.disable_by_batch_size}
    if config.max_num_speculative_tokens is not None:
        options["max_num_speculative_tokens"] = config.max_num_speculative_tokens
    return get_speculation_policy(config.policy, config.num_speculative_tokens, **options)


__all__ = ["AdaptiveSpeculation", "FixedSpeculation", "available_speculation_policies",
           "get_speculation_policy", "speculation_policy_for"]
