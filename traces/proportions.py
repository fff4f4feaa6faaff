"""Seeded draws of labels (tenants, priority classes) in given proportions."""

from __future__ import annotations

import math
from typing import TypeVar

import numpy as np

K = TypeVar("K", str, int)


def check_proportions(proportions: dict[K, float], name: str) -> None:
    """Non-empty, every weight finite and >= 0, at least one > 0; weights need not sum to 1."""
    if not proportions:
        raise ValueError(f"{name} must not be empty.")
    for label, weight in proportions.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{name}: weight of {label!r} must be a finite number >= 0, got {weight!r}.")
    if sum(proportions.values()) <= 0:
        raise ValueError(f"{name}: weights must not all be 0.")


def draw_labels(rng: np.random.Generator, proportions: dict[K, float], n: int, name: str) -> list[K]:
    """``n`` labels drawn independently, label ``k`` with probability ``w_k / sum(w)``."""
    check_proportions(proportions, name)
    labels = list(proportions)
    weights = np.array([proportions[k] for k in labels], dtype=float)
    picks = rng.choice(len(labels), size=n, p=weights / weights.sum())
    return [labels[i] for i in picks.tolist()]
