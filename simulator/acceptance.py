"""How many drafts the twin accepts: a per-position acceptance model, given by the user
(``synthetic_acceptance_rate``) or measured on real runs (an ``AcceptanceProfile`` file).

Decisions:

- Rates are conditional: ``rates[j]`` is the chance that draft position ``j`` is accepted once
  the drafts before it were (the count stops at the first rejection, as a rejection sampler's
  does); a list shorter than k_max repeats its last rate.
- Draws are counter-based rather than one stream: draft slot ``j`` proposing the request's token
  at position ``p`` is accepted iff ``u(seed, request, p) < rates[j]``. A token is then as easy
  to guess whatever the batch, the policy or the k that proposed it, as text is in reality, so
  runs that differ only in their speculation policy see the same workload (common random
  numbers) and a comparison of fixed k against adaptive is not noise.
- A measured profile holds vLLM's counters (verifications and accepted tokens per position):
  ``rates[0] = accepted[0] / drafts``, ``rates[j] = accepted[j] / accepted[j - 1]``, exact for
  runs with a fixed k (every verification reaches every position). Where only the totals are
  known (a run folder's per-request counts), one rate ``r`` is fitted so that a verification
  of the run's mean k accepts the measured mean: ``sum_{j=1..k} r^j``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinserve.core.speculative_config import SpeculativeConfig
from twinserve.traces.trace_request import stable_seed

_MASK64 = (1 << 64) - 1
_SPAN = float(1 << 64)


def _uniform(key: int, position: int) -> float:
    """A uniform in [0, 1) from ``key`` and ``position`` (splitmix64's finaliser)."""
    z = (key + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) / _SPAN


def _check_rates(rates: Sequence[float], name: str) -> tuple[float, ...]:
    if isinstance(rates, (str, bytes)) or not rates or any(
            isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0
            for r in rates):
        raise ValueError(f"{name} must be a non-empty list of numbers in [0, 1], got {rates!r}.")
    return tuple(float(r) for r in rates)


class AcceptanceModel:
    """Per-position conditional acceptance rates and seeded, counter-based draws (module doc)."""

    __slots__ = ("rates", "seed", "_keys")

    def __init__(self, rates: Sequence[float], seed: int = 0) -> None:
        self.rates = _check_rates(rates, "acceptance rates")
        self.seed = seed
        self._keys: dict[str, int] = {}  # request id -> its draw key (dropped with the request)

    @classmethod
    def of(cls, spec: SpeculativeConfig | None, seed: int = 0,
           profile: AcceptanceProfile | None = None) -> AcceptanceModel | None:
        """The model the twin runs (None: speculation off): ``profile``'s rates when given,
        else the configuration's ``synthetic_acceptance_rate``."""
        if spec is None:
            return None
        if profile is not None:
            return cls(profile.rates, seed)
        if not spec.acceptance_rates:
            raise ValueError("the twin needs the drafts' acceptance: speculative_config."
                             "synthetic_acceptance_rate (with rejection_sample_method "
                             "'synthetic') or a measured acceptance profile "
                             "(--acceptance-profile).")
        return cls(spec.acceptance_rates, seed)

    def rate(self, slot: int) -> float:
        rates = self.rates
        return rates[slot if slot < len(rates) else -1]

    def num_accepted(self, request_id: str, position: int, num_drafts: int) -> int:
        """Accepted drafts of a verification of ``num_drafts`` whose first draft stands at
        token ``position`` of request ``request_id``."""
        key = self._keys.get(request_id)
        if key is None:
            key = self._keys[request_id] = stable_seed(f"{self.seed}:{request_id}")
        for j in range(num_drafts):
            if _uniform(key, position + j) >= self.rate(j):
                return j
        return num_drafts

    def release(self, request_id: str) -> None:
        self._keys.pop(request_id, None)

    def expected_accepted(self, num_drafts: int) -> float:
        """Mean accepted drafts of a verification of ``num_drafts``."""
        total, reach = 0.0, 1.0
        for j in range(num_drafts):
            reach *= self.rate(j)
            total += reach
        return total


@dataclass(frozen=True, slots=True)
class AcceptanceProfile:
    """Acceptance measured on a workload: the counters it came from and the rates they give."""

    workload: str
    rates: tuple[float, ...]
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rates", _check_rates(self.rates, "AcceptanceProfile.rates"))
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"AcceptanceProfile.{name} must be an integer >= 0, got {value!r}.")

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification, the sampled one included (vLLM's figure)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @classmethod
    def from_counts(cls, workload: str, num_drafts: int, accepted_per_pos: Sequence[int],
                    num_draft_tokens: int = 0, source: str = "") -> AcceptanceProfile:
        """Rates from vLLM's per-position counters (exact for a fixed k)."""
        if num_drafts <= 0:
            raise ValueError(f"num_drafts must be > 0 to measure acceptance, got {num_drafts!r}.")
        rates, reached = [], num_drafts
        for accepted in accepted_per_pos:
            rates.append(min(1.0, accepted / reached) if reached else 0.0)
            reached = accepted
        return cls(workload, tuple(rates), num_drafts, num_draft_tokens,
                   sum(accepted_per_pos), tuple(accepted_per_pos), source)

    @classmethod
    def from_totals(cls, workload: str, num_drafts: int, num_draft_tokens: int,
                    num_accepted_tokens: int, source: str = "") -> AcceptanceProfile:
        """One rate fitted to the totals (module doc), for runs without per-position counters."""
        if num_drafts <= 0 or num_draft_tokens <= 0:
            raise ValueError("num_drafts and num_draft_tokens must be > 0 to measure acceptance.")
        k = max(1, round(num_draft_tokens / num_drafts))
        target = min(num_accepted_tokens / num_drafts, float(k))
        lo, hi = 0.0, 1.0
        for _ in range(60):  # sum_{j=1..k} r^j is increasing in r: bisect
            mid = (lo + hi) / 2
            if sum(mid ** j for j in range(1, k + 1)) < target:
                lo = mid
            else:
                hi = mid
        return cls(workload, (round(hi, 6),), num_drafts, num_draft_tokens, num_accepted_tokens,
                   (), source)

    @classmethod
    def from_records(cls, workload: str, records: Sequence[Any], source: str = "") -> AcceptanceProfile:
        """From a run's per-request counts (``RequestRecord`` or rows with the same names)."""
        drafts = sum(int(r.spec_num_drafts) for r in records)
        tokens = sum(int(r.spec_num_draft_tokens) for r in records)
        accepted = sum(int(r.spec_num_accepted_tokens) for r in records)
        return cls.from_totals(workload, drafts, tokens, accepted, source)

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "rates": list(self.rates), "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos),
                "mean_acceptance_length": self.mean_acceptance_length, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AcceptanceProfile:
        if not isinstance(data, dict) or "rates" not in data:
            raise ValueError("an acceptance profile must be a JSON object with 'rates'.")
        known = ("workload", "rates", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                 "accepted_per_pos", "source")
        values = {k: data[k] for k in known if k in data}
        values.setdefault("workload", "")
        values["rates"] = tuple(values["rates"]) if isinstance(values["rates"], list) else values["rates"]
        values["accepted_per_pos"] = tuple(values.get("accepted_per_pos", ()))
        return cls(**values)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> AcceptanceProfile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"acceptance profile {str(path)!r} cannot be read: {exc}") from None
        return cls.from_dict(data)


__all__ = ["AcceptanceModel", "AcceptanceProfile"]
