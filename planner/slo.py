"""The SLOs a plan must meet and the verdict of one replay, decided as early as it is known.

An SLO is a limit on one latency metric and the fraction of all requests that must meet it:
``ttft_p90_ms=2000`` reads "at least 90% of the requests have a TTFT of at most 2,000 ms" (the
nearest-rank percentile, as Vidur-Search's "TTFT-P90 < 2 s"); a key without a percentile
(``ttft_ms=2000``) takes the plan's ``attainment`` as its fraction. A request meets a limit when it
succeeded and its value is within it; a TPOT that does not exist (a one-token reply) passes, as in
``simulator.sweep_table``; a request that failed, was refused or never finished misses them all.

A replay passes when every SLO holds over all the requests of the trace, so its verdict is known
before it ends: it fails as soon as one metric's misses exceed what its fraction allows, and passes
as soon as every metric has enough requests meeting it, whatever the unfinished requests do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from twinserve.core.metrics import RequestRecord

METRICS = ("ttft", "tpot", "e2el")
_KEY = re.compile(r"^(ttft|tpot|e2el)(?:_p(\d{1,2}(?:\.\d+)?))?_ms$")
PASS, FAIL = "pass", "fail"


@dataclass(frozen=True, slots=True)
class Slo:
    """``fraction`` of all requests must have ``metric`` (seconds in records) <= ``limit_ms``."""

    key: str
    metric: str
    limit_ms: float
    fraction: float

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"slo {self.key!r}: metric must be one of {METRICS}, got {self.metric!r}.")
        if not (math.isfinite(self.limit_ms) and self.limit_ms > 0):
            raise ValueError(f"slo {self.key!r}: the limit must be a number of ms > 0, "
                             f"got {self.limit_ms!r}.")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"slo {self.key!r}: the fraction must be in (0, 1], got {self.fraction!r}.")

    def meets(self, record: RequestRecord) -> bool:
        return record.success and self.meets_ms(getattr(record, self.metric) * 1000.0)

    def meets_ms(self, value_ms: float) -> bool:
        """Whether a succeeded request's value (ms; NaN: none, e.g. a one-token TPOT) passes."""
        return math.isnan(value_ms) or value_ms <= self.limit_ms

    def needed(self, total: int) -> int:
        """How many of ``total`` requests must meet the limit."""
        return math.ceil(self.fraction * total - 1e-9)


def parse_slo(key: str, value: object, attainment: float) -> Slo:
    """``ttft_p90_ms`` and 2000 -> an Slo; ValueError naming the key when either is wrong."""
    match = _KEY.fullmatch(key.strip()) if isinstance(key, str) else None
    if match is None:
        raise ValueError(f"slo key {key!r}: expected <metric>_ms or <metric>_p<percentile>_ms with "
                         f"metric one of {', '.join(METRICS)} (e.g. ttft_p90_ms).")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"slo {key!r}: the limit must be a number of ms, got {value!r}.")
    percentile = match.group(2)
    fraction = float(percentile) / 100.0 if percentile is not None else attainment
    if percentile is not None and not 0 < fraction < 1:
        raise ValueError(f"slo {key!r}: the percentile must be in (0, 100), got {percentile}.")
    return Slo(key.strip(), match.group(1), float(value), fraction)


def parse_slo_flag(text: str, attainment: float) -> Slo:
    """``--slo ttft_p90_ms=2000``."""
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--slo {text!r}: expected KEY=MS, e.g. ttft_p90_ms=2000.")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"slo {key!r}: the limit must be a number of ms, got {value!r}.") from None
    return parse_slo(key, number, attainment)


@dataclass(slots=True)
class VerdictTracker:
    """Counts, per SLO, the finished requests meeting and missing it, over a replay of ``total``
    requests; ``update`` reads the records finished so far (a growing list) incrementally.
    ``stop_on``: the verdicts that end the replay (``simulate``'s ``stop_when``)."""

    slos: tuple[Slo, ...]
    total: int
    stop_on: tuple[str, ...] = (FAIL,)
    _seen: int = 0
    _met: list[int] = field(default_factory=list)
    _missed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.slos:
            raise ValueError("slos: at least one SLO is needed.")
        if self.total < 1:
            raise ValueError(f"total must be >= 1, got {self.total!r}.")
        self._met, self._missed = [0] * len(self.slos), [0] * len(self.slos)

    def update(self, records: Sequence[RequestRecord]) -> bool:
        """Counts the records past those already seen; True once the verdict is one of
        ``stop_on``."""
        for record in records[self._seen:]:
            for i, slo in enumerate(self.slos):
                if slo.meets(record):
                    self._met[i] += 1
                else:
                    self._missed[i] += 1
        self._seen = len(records)
        verdict = self.decided
        return verdict is not None and verdict in self.stop_on

    @property
    def decided(self) -> str | None:
        """``fail`` when some SLO has more misses than it allows, ``pass`` when every SLO has
        enough requests meeting it, else ``None`` (the unfinished requests could go either way)."""
        if any(missed > self.total - slo.needed(self.total)
               for slo, missed in zip(self.slos, self._missed)):
            return FAIL
        if all(met >= slo.needed(self.total) for slo, met in zip(self.slos, self._met)):
            return PASS
        return None

    def final(self) -> str:
        """The verdict once the replay is over: requests never recorded count as misses."""
        return self.decided or FAIL

    def attainment(self) -> dict[str, float]:
        """Per SLO key, the fraction of all requests known to meet it."""
        return {slo.key: met / self.total for slo, met in zip(self.slos, self._met)}


def table_verdict(success: Sequence[bool], values_ms: dict[str, Sequence[float]],
                  slos: tuple[Slo, ...], total: int) -> tuple[str, dict[str, float]]:
    """The verdict and per-SLO attainment of a run read back from its table (a run folder's
    ``requests.csv``: ``success`` and ``<metric>_ms`` columns) of ``total`` requests sent."""
    met = {slo.key: sum(ok and slo.meets_ms(float(v)) for ok, v in zip(success, values_ms[slo.metric]))
           for slo in slos}
    verdict = PASS if all(met[s.key] >= s.needed(total) for s in slos) else FAIL
    return verdict, {k: v / total for k, v in met.items()}
