"""LoRA adapters in a workload: which adapter each request names, and the adapters' shapes.

A request names its adapter by ``TraceRequest.lora`` (``None``: the base model), from a trace's
``lora``/``adapter`` column or drawn with ``assign_loras``. ``--loras`` is written like ``--tenants``:

- ``a=3,b=1``: adapters ``a`` and ``b`` drawn per request with weights 3 and 1;
- ``32``: 32 adapters ``lora0`` .. ``lora31`` of weight 1 each (a bare count may be mixed in:
  ``32,base=8``);
- ``base=W``: the share of requests served by the base model (no adapter);
- ``a=3:8``: adapter ``a`` has rank 8 (the others ``--lora-rank``).

The shapes (``LoRAAdapters``: a rank and the PEFT target modules, one for all adapters unless a
rank is given per adapter) are what the twin's cost model charges; the real engine reads them from
each adapter's ``adapter_config.json``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from twinserve.core.lora import PEFT_TARGET_MODULES
from twinserve.traces.proportions import draw_labels
from twinserve.traces.trace_request import TraceRequest

BASE_MODEL = "base"  # the --loras entry (and summary key) for requests without an adapter
ALL_MODULES = "all"
COUNT_PREFIX = "lora"  # --loras N names its adapters lora0 .. lora{N-1}
# The adapter draw's own stream, so that --loras and --tenants with the same seed and as many
# labels do not pick the same index sequence.
_LORA_STREAM = 0x10_4A


@dataclass(frozen=True, slots=True)
class AdapterShape:
    """One adapter as the cost model sees it: its rank and the projections it adapts."""

    rank: int = 16
    target_modules: tuple[str, ...] = PEFT_TARGET_MODULES

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}.")
        modules = tuple(self.target_modules)
        unknown = sorted(set(modules) - set(PEFT_TARGET_MODULES))
        if not modules or unknown or len(set(modules)) != len(modules):
            raise ValueError(f"target_modules must be distinct names among "
                             f"{', '.join(PEFT_TARGET_MODULES)} (or {ALL_MODULES!r}), got "
                             f"{list(modules)}.")
        # canonical order: two spellings of one set are one shape
        object.__setattr__(self, "target_modules",
                           tuple(m for m in PEFT_TARGET_MODULES if m in modules))


@dataclass(frozen=True, slots=True)
class LoRAAdapters:
    """The shapes of a workload's adapters: ``default`` for every adapter, but the rank of those
    listed in ``ranks`` ((name, rank) pairs). Plain tuples: a sweep pickles it to its workers."""

    default: AdapterShape = AdapterShape()
    ranks: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple((str(n), r) for n, r in self.ranks))
        for name, rank in self.ranks:
            AdapterShape(rank, self.default.target_modules)  # validates the rank
            if not name or name == BASE_MODEL:
                raise ValueError(f"adapter name must be non-empty and not {BASE_MODEL!r}, got "
                                 f"{name!r}.")

    def shape(self, name: str) -> AdapterShape:
        """The shape of adapter ``name``."""
        for listed, rank in self.ranks:
            if listed == name:
                return dataclasses.replace(self.default, rank=rank)
        return self.default

    def max_rank(self, names: Iterable[str]) -> int:
        return max((self.shape(n).rank for n in names), default=0)


def parse_target_modules(text: str) -> tuple[str, ...]:
    """``all`` or comma-separated PEFT names (``q_proj,v_proj``) -> the modules, validated."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    modules = PEFT_TARGET_MODULES if names == [ALL_MODULES] else tuple(names)
    return AdapterShape(1, modules).target_modules


def parse_loras(text: str) -> tuple[dict[str, float], dict[str, int]]:
    """``--loras`` (see the module docstring) -> ({label: weight}, {adapter: rank}); the label
    ``BASE_MODEL`` stands for the base model."""
    weights: dict[str, float] = {}
    ranks: dict[str, int] = {}
    for raw in text.split(","):
        item = raw.strip()
        if item.isdigit():
            count = int(item)
            if count < 1:
                raise ValueError(f"an adapter count must be >= 1, got {item!r} in {text!r}.")
            weights.update({f"{COUNT_PREFIX}{i}": 1.0 for i in range(count)})
            continue
        name, weight, rank = _lora_item(item, text)
        weights[name] = weight
        if rank is not None:
            if name == BASE_MODEL:
                raise ValueError(f"{BASE_MODEL!r} is the base model: it has no rank ({item!r}).")
            ranks[name] = rank
    return weights, ranks


def _lora_item(item: str, text: str) -> tuple[str, float, int | None]:
    name, sep, value = item.partition("=")
    weight_text, colon, rank_text = value.partition(":")
    try:
        if not sep or not name.strip():
            raise ValueError
        weight = float(weight_text)
        rank = int(rank_text) if colon else None
    except ValueError:
        raise ValueError(f"expected NAME=WEIGHT[:RANK],... or a count, got {item!r} in "
                         f"{text!r}.") from None
    return name.strip(), weight, rank


def assign_loras(reqs: list[TraceRequest], proportions: dict[str, float],
                 seed: int = 0) -> list[TraceRequest]:
    """Each request's adapter drawn independently with the given weights (seeded, its own stream);
    the label ``base`` means no adapter."""
    if any(not isinstance(name, str) or not name for name in proportions):
        raise ValueError(f"adapter names must be non-empty strings, got {list(proportions)}.")
    rng = np.random.default_rng((seed, _LORA_STREAM))
    labels = draw_labels(rng, proportions, len(reqs), "adapter proportions")
    return [dataclasses.replace(r, lora=None if label == BASE_MODEL else label)
            for r, label in zip(reqs, labels)]


def adapter_names(reqs: Iterable[TraceRequest]) -> list[str]:
    """The distinct adapters the requests name, sorted."""
    return sorted({r.lora for r in reqs if r.lora is not None})
