"""The ``validate`` flags a fleet's validate (replicas, or prefill and decode instances) does
not run, refused by name: it replays its fleet on a profile given with ``--profile``, without
the single engine's speed probes, profile cache or detokenization switch."""

from __future__ import annotations

import argparse

# (the namespace's attribute, its default, the flag and why)
FLEET_REFUSED_FLAGS = (
    ("reuse_real", None, "--reuse-real"),
    ("at_host_speed", False, "--at-host-speed (its engines run no speed probe)"),
    ("full_space", False, "--calibrate-full-space (it takes --profile)"),
    ("acceptance_profile", None, "--acceptance-profile (no speculation in a fleet)"),
    ("profile_cache", None, "--profile-cache (it takes --profile)"),
    ("use_profile_cache", True, "--no-profile-cache (it takes --profile)"),
    ("detokenize", True, "--no-detokenize"),
)


def refuse_fleet_flags(args: argparse.Namespace, option: str) -> None:
    """ValueError naming the first of ``FLEET_REFUSED_FLAGS`` given with ``option`` (the
    fleet's flag, e.g. ``--data-parallel-size``)."""
    for name, default, flag in FLEET_REFUSED_FLAGS:
        value = getattr(args, name, default)
        if value is not None and value != default:
            raise ValueError(f"{flag} is not supported with {option}.")
