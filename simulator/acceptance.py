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
  of the run's draft lengths (the two whole numbers around their mean) accepts the measured
  mean: ``sum_{j=1..k} r^j`` averaged over those lengths.
- A lookup proposer (ngram, suffix) finds drafts only where the text repeats, and then often
  fewer than k: a measured profile also holds ``proposal_rate`` (the share of steps that
  verified drafts) and ``mean_draft_length``, and the twin's proposals follow them (seeded per
  request and token as the acceptance is).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinserve.core.speculative_config import SpeculativeConfig
from twinserve.traces.trace_request import stable_seed

_MASK64 = (1 << 64) - 1
_PROPOSAL_SALT, _LENGTH_SALT = 0x5DEECE66D, 0x2545F4914F6CDD1D
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


def _check_proposals(proposal_rate: float, mean_draft_length: float) -> None:
    if isinstance(proposal_rate, bool) or not isinstance(proposal_rate, (int, float)) \
            or not 0.0 <= proposal_rate <= 1.0:
        raise ValueError(f"proposal_rate must be a number in [0, 1], got {proposal_rate!r}.")
    if isinstance(mean_draft_length, bool) or not isinstance(mean_draft_length, (int, float)) \
            or not mean_draft_length >= 0:
        raise ValueError(f"mean_draft_length must be a number >= 0, got {mean_draft_length!r}.")


class AcceptanceModel:
    """Per-position conditional acceptance rates and seeded, counter-based draws (module doc)."""

    __slots__ = ("rates", "seed", "proposal_rate", "mean_draft_length", "_keys")

    def __init__(self, rates: Sequence[float], seed: int = 0, proposal_rate: float = 1.0,
                 mean_draft_length: float = 0.0) -> None:
        self.rates = _check_rates(rates, "acceptance rates")
        _check_proposals(proposal_rate, mean_draft_length)
        self.seed = seed
        self.proposal_rate, self.mean_draft_length = float(proposal_rate), float(mean_draft_length)
        self._keys: dict[str, int] = {}  # request id -> its draw key (dropped with the request)

    @classmethod
    def of(cls, spec: SpeculativeConfig | None, seed: int = 0,
           profile: AcceptanceProfile | None = None) -> AcceptanceModel | None:
        """The model the twin runs (None: speculation off): ``profile``'s rates when given,
        else the configuration's ``synthetic_acceptance_rate``."""
        if spec is None:
            return None
        if profile is not None:
            return cls(profile.rates, seed, profile.proposal_rate, profile.mean_draft_length)
        if not spec.acceptance_rates:
            raise ValueError("the twin needs the drafts' acceptance: speculative_config."
                             "synthetic_acceptance_rate (with rejection_sample_method "
                             "'synthetic') or a measured acceptance profile "
                             "(--acceptance-profile).")
        return cls(spec.acceptance_rates, seed)

    def rate(self, slot: int) -> float:
        rates = self.rates
        return rates[slot if slot < len(rates) else -1]

    def _key(self, request_id: str) -> int:
        key = self._keys.get(request_id)
        if key is None:
            key = self._keys[request_id] = stable_seed(f"{self.seed}:{request_id}")
        return key

    def num_proposed(self, request_id: str, position: int, wanted: int) -> int:
        """Drafts the proposer finds for a request asking ``wanted`` after its token
        ``position``: none with chance ``1 - proposal_rate``; else ``mean_draft_length`` on
        average (the two whole numbers around it), or ``wanted`` when that is 0; at most
        ``wanted``."""
        if self.proposal_rate >= 1.0 and not self.mean_draft_length:
            return wanted
        key = self._key(request_id) ^ _PROPOSAL_SALT
        if _uniform(key, position) >= self.proposal_rate:
            return 0
        mean = self.mean_draft_length
        if not mean:
            return wanted
        whole = int(mean)
        length = whole + (_uniform(key ^ _LENGTH_SALT, position) < mean - whole)
        return min(wanted, length)

    def num_accepted(self, request_id: str, position: int, num_drafts: int) -> int:
        """Accepted drafts of a verification of ``num_drafts`` whose first draft stands at
        token ``position`` of request ``request_id``."""
        key = self._key(request_id)
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
    proposal_rate: float = 1.0  # share of draft requests the proposer found drafts for
    mean_draft_length: float = 0.0  # drafts per proposal (0: as many as asked)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rates", _check_rates(self.rates, "AcceptanceProfile.rates"))
        _check_proposals(self.proposal_rate, self.mean_draft_length)
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
        mean = num_draft_tokens / num_drafts
        whole = int(mean)  # the drafts' lengths: the two whole numbers around their mean
        weights = ((whole, 1.0 - (mean - whole)), (whole + 1, mean - whole))
        target = min(num_accepted_tokens / num_drafts, mean)
        lo, hi = 0.0, 1.0
        for _ in range(60):  # the expected accepted count is increasing in r: bisect
            mid = (lo + hi) / 2
            expected = sum(w * sum(mid ** j for j in range(1, n + 1)) for n, w in weights)
            if expected < target:
                lo = mid
            else:
                hi = mid
        return cls(workload, (round(hi, 6),), num_drafts, num_draft_tokens, num_accepted_tokens,
                   (), source)

    @classmethod
    def measured(cls, workload: str, *, num_drafts: int, num_draft_tokens: int,
                 num_accepted_tokens: int, k_max: int, output_tokens: int, num_requests: int,
                 accepted_per_pos: Sequence[int] = (), source: str = "") -> AcceptanceProfile:
        """A run's acceptance (module doc), with how often the proposer found drafts:
        ``proposal_rate`` = verifications / the steps that could verify (each request's steps
        after its first: output - accepted - 1 tokens), and their mean length where it falls
        short of ``k_max`` (a lookup that matched fewer tokens)."""
        mean = num_draft_tokens / num_drafts if num_drafts else 0.0
        full = mean >= 0.9 * k_max  # (drafts are clipped at a request's end: not all k_max)
        base = (cls.from_counts(workload, num_drafts, accepted_per_pos, num_draft_tokens, source)
                if full and accepted_per_pos else
                cls.from_totals(workload, num_drafts, num_draft_tokens, num_accepted_tokens, source))
        chances = output_tokens - num_accepted_tokens - num_requests
        return dataclasses.replace(
            base, num_accepted_tokens=num_accepted_tokens, accepted_per_pos=tuple(accepted_per_pos),
            proposal_rate=min(1.0, num_drafts / chances) if chances > 0 else 1.0,
            mean_draft_length=0.0 if full else round(mean, 4))

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "rates": list(self.rates),
                "proposal_rate": self.proposal_rate, "mean_draft_length": self.mean_draft_length,
                "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos),
                "mean_acceptance_length": self.mean_acceptance_length, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AcceptanceProfile:
        if not isinstance(data, dict) or "rates" not in data:
            raise ValueError("an acceptance profile must be a JSON object with 'rates'.")
        known = ("workload", "rates", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                 "accepted_per_pos", "source", "proposal_rate", "mean_draft_length")
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
