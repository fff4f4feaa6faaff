"""Pareto fronts of the searched configurations, and the bound that lets a plan skip the
configurations that cannot beat the best found.

**The bound.** A plan ranks configurations by cost per output token, that is by sustained output
tokens/s (at capacity) per dollar-hour: ``tokens / (gpus * price)``. Before searching a
configuration, it looks up the configurations already searched with the same hardware, engine
arguments and, for disaggregated prefill/decode, the same x:y ratio and link
(``Candidate.replica_key``: no bound crosses from aggregated to xPyD or between ratios, where a
split can gain far more than any slack) on fewer GPUs, whose step times rest on the same kind of
model (a measured fit, or a roofline: the twin may hold a fit at TP 1 and only a roofline at TP 2,
and the two differ by more than any slack), and bounds its throughput per GPU by ``slack`` times
the best of theirs::

    tokens(C) / gpus(C)  <=  slack * max { tokens(B) / gpus(B) : B searched, same key, gpus(B) < gpus(C) }

that is, adding GPUs to the same engine (more replicas, a larger TP or PP) does not raise the
throughput per GPU by more than ``slack``. Replicas behind a router scale about linearly in
throughput, a larger TP pays all-reduces, PP a bubble; the slack (default 1.5) covers what a
larger TP gains from the KV memory its weights free, and what a router gains under a tail SLO
(spreading arrivals over replicas smooths each one's bursts, which on short or bursty replays can
raise the capacity per replica well above linear). It is an assumption about serving, not a
theorem: ``slack`` 0 turns skipping off, and the plan then searches every configuration. A base
with no capacity bounds nothing.

**When it skips.** Configurations are searched in waves of growing GPU count. A configuration C
is skipped (``dominated``) exactly when (1) ``slack`` > 0, (2) some configuration of C's key on
fewer GPUs was searched in an earlier wave and has a capacity, and (3) C's bound per dollar-hour,
``slack * max per-GPU tokens/s of those * gpus(C) / (gpus(C) * price(C))``, is strictly below the
best tokens/s per dollar-hour among the configurations fitted in earlier waves.

**What it keeps.** Call A(slack) the assumption that for any two configurations B and C of one key
with gpus(B) < gpus(C) and B fitted, ``tokens(C) / gpus(C) <= slack * tokens(B) / gpus(B)``.
Where A(slack) holds, a skipped configuration's true tokens/s per dollar-hour is below the best
found before its wave, hence below the plan's best, and the plan's best is never skipped (its
bound is at least its own value, which no earlier configuration beats): the recommendation
(``best.yaml``) is the one an exhaustive search gives, provided each configuration's capacity
does not depend on where its bracketing search starts (replays that pass below the capacity and
fail above it, as ``search`` assumes; a skipped configuration no longer gives its siblings a
starting estimate). Skipping does **not** keep the Pareto fronts: the bound limits throughput per
GPU only, not throughput per user or TTFT, so a skipped configuration may belong to either front
(more replicas of one engine, loaded a little less per GPU at the grid's capacity, often sit on
the throughput front beside it). ``front.csv`` holds the fronts of the configurations searched;
plan with ``dominance_slack: 0`` for the exhaustive fronts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def pareto_mask(points: Sequence[tuple[float, float]], maximize: tuple[bool, bool]) -> list[bool]:
    """Whether each point is on the front: no other point is at least as good on both axes and
    better on one. NaN points are never on it; equal points are all on it."""
    signed = [(x if maximize[0] else -x, y if maximize[1] else -y) for x, y in points]
    mask = []
    for i, (x, y) in enumerate(signed):
        if math.isnan(x) or math.isnan(y):
            mask.append(False)
            continue
        dominated = any(j != i and ox >= x and oy >= y and (ox > x or oy > y)
                        for j, (ox, oy) in enumerate(signed)
                        if not (math.isnan(ox) or math.isnan(oy)))
        mask.append(not dominated)
    return mask


@dataclass(frozen=True, slots=True)
class Searched:
    """What the bound needs of a configuration already searched."""

    replica_key: tuple[object, ...]
    gpus: int
    capacity_rps: float  # NaN: no capacity


def capacity_bound(key: tuple[object, ...], gpus: int, searched: Sequence[Searched],
                   slack: float) -> float | None:
    """The bound above on the capacity (the unit of ``searched``'s) of a configuration of ``key`` on
    ``gpus`` GPUs;
    ``None`` when no base bounds it (none searched, or none with capacity, or slack 0)."""
    if slack <= 0:
        return None
    per_gpu = [s.capacity_rps / s.gpus for s in searched
               if s.replica_key == key and s.gpus < gpus and s.capacity_rps > 0]
    if not per_gpu:
        return None
    return slack * max(per_gpu) * gpus


def is_dominated(bound: float | None, gpus: int, price: float, best_per_dollar: float) -> bool:
    """Whether a configuration whose capacity is at most ``bound`` (any unit: output tokens/s
    for the plan) cannot beat the best capacity per dollar-hour found, in the same unit."""
    if bound is None or not best_per_dollar > 0:
        return False
    return bound / (gpus * price) < best_per_dollar
