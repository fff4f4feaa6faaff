"""Scheduling policies, registered by name. Import this package to register the built-ins."""

from twinserve.policies import fair, fcfs, lora_affinity, priority, sjf, static  # noqa: F401  (registration)
from twinserve.policies.registry import available_policies, get_policy, register

__all__ = ["available_policies", "get_policy", "register"]
