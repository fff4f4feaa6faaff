"""A KV-transfer link's parameters (``LinkSpec``): what the twin's flow model
(``simulator/kv_transfer.py``) runs and what a measurement of this machine's connector
(``gpu/measurement/kv_transfer.py``) writes into a profile as ``kv_link``. Plain data, so both
sides of the dependency rule share one record."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class LinkSpec:
    """One instance's link for KV transfers: bandwidth per direction (the capacity its flows
    share), a fixed latency that concurrent transfers overlap, a fixed per-transfer overhead
    that they share, and the most one flow can move (``flow_bandwidth_bytes_per_s``: None, as
    given, becomes ``bandwidth_bytes_per_s``)."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str = ""  # where the numbers come from ("" = assumed)
    overhead_s: float = 0.0
    flow_bandwidth_bytes_per_s: float | None = None
    first_touch_s_per_byte: float = 0.0  # the CPU consumer's rules (module docstring)
    consumer_step_share: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("kv_link name must be a non-empty string.")
        bw = self.bandwidth_bytes_per_s
        _check("bandwidth_bytes_per_s", bw, 0 < _num(bw) < math.inf, "a positive number")
        _check("latency_s", self.latency_s, 0 <= _num(self.latency_s) < math.inf, "a number >= 0")
        _check("overhead_s", self.overhead_s, 0 <= _num(self.overhead_s) < math.inf,
               "a number >= 0")
        cap = bw if self.flow_bandwidth_bytes_per_s is None else self.flow_bandwidth_bytes_per_s
        _check("flow_bandwidth_bytes_per_s", cap, 0 < _num(cap) <= bw,
               f"a positive number no larger than bandwidth_bytes_per_s ({bw!r})")
        object.__setattr__(self, "flow_bandwidth_bytes_per_s", cap)
        _check("first_touch_s_per_byte", self.first_touch_s_per_byte,
               0 <= _num(self.first_touch_s_per_byte) < 1, "a number in [0, 1)")
        _check("consumer_step_share", self.consumer_step_share,
               0 < _num(self.consumer_step_share) <= 1, "a number in (0, 1]")

    @property
    def cpu_consumer(self) -> bool:
        """Whether the link carries a CPU consumer's rules (either differs from its default)."""
        return self.first_touch_s_per_byte > 0 or self.consumer_step_share < 1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], name: str = "measured") -> LinkSpec:
        if not isinstance(data, Mapping):
            raise ValueError(f"kv_link must be a mapping, got {type(data).__name__}.")
        known = {"name", "bandwidth_bytes_per_s", "latency_s", "source", "overhead_s",
                 "flow_bandwidth_bytes_per_s", "first_touch_s_per_byte", "consumer_step_share"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv_link: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))}).")
        for key in ("bandwidth_bytes_per_s", "latency_s"):
            if key not in data:
                raise ValueError(f"kv_link.{key} is required.")
        return cls(str(data.get("name", name)), data["bandwidth_bytes_per_s"], data["latency_s"],
                   str(data.get("source", "")), data.get("overhead_s", 0.0),
                   data.get("flow_bandwidth_bytes_per_s"),
                   data.get("first_touch_s_per_byte", 0.0), data.get("consumer_step_share", 1.0))

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
               "latency_s": self.latency_s, "source": self.source}
        if self.overhead_s:  # (absent: the files of links without one stay as they were)
            out["overhead_s"] = self.overhead_s
        if self.flow_rate != self.bandwidth_bytes_per_s:  # (likewise)
            out["flow_bandwidth_bytes_per_s"] = self.flow_rate
        if self.first_touch_s_per_byte:
            out["first_touch_s_per_byte"] = self.first_touch_s_per_byte
        if self.consumer_step_share != 1.0:
            out["consumer_step_share"] = self.consumer_step_share
        return out

    @property
    def flow_rate(self) -> float:
        """The most one flow can move per second (its cap, as a float)."""
        cap = self.flow_bandwidth_bytes_per_s
        return float(self.bandwidth_bytes_per_s if cap is None else cap)

    @property
    def overhead_bytes(self) -> float:
        """The overhead as bytes a flow carries on top of its own (at a lone flow's rate)."""
        return self.overhead_s * self.flow_rate

    def scaled(self, lanes: int) -> LinkSpec:
        """The link of an instance of ``lanes`` GPUs (tensor parallelism: each GPU sends its
        shard of the KV over its own link, in parallel: a flow's cap scales too)."""
        return LinkSpec(self.name, self.bandwidth_bytes_per_s * lanes, self.latency_s, self.source,
                        self.overhead_s, self.flow_rate * lanes, self.first_touch_s_per_byte,
                        self.consumer_step_share)


def _num(value: Any) -> float:
    """``value`` if it is a real number (not a bool), else NaN (which fails every range)."""
    return math.nan if isinstance(value, bool) or not isinstance(value, (int, float)) else value


def _check(key: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"kv_link.{key} must be {what}, got {value!r}.")
