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

Bursty acceptance, measured (``CopyChain``; profile format version 2): ``simulator/copy_chain.py``.

Whole requests, measured (``RequestUnit``; profile format version 3):

- A profile also holds one unit per request of the run's ``drafts.csv``: the output offset
  where it started copying (by the chain's rule; None where it never did within the ``span``
  of output its record covers), its copy length, and its searching steps' counts. Where the
  profile's ``draws`` is ``"requests"``, each twin request draws one unit by its id (a
  bootstrap of whole requests: finding, acceptance and onset move together, as they do per
  request) and replays it: searching with the unit's own proposal rate, draft length and one
  rate fitted to its totals until its onset, counted in output tokens from the request's
  first proposal, then copying its copy length whole. Past a unit's span it keeps its state.
- Measured profiles with units draw them (``"requests"``). Held out by requests (acceptance
  measured on other windows of the same trace) the units carry the tail, which pooled draws,
  giving every request the same speed, cannot. Held out by kind (another workload's shape)
  neither carries over: when requests start copying differs between workloads and follows
  neither the prompt's length nor the output's (``docs/speculative-decoding.md``, "Whole
  requests"). The other draws stay available by setting ``draws`` in the file.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinserve.core.draft_record import DraftStep
from twinserve.core.speculative_config import SpeculativeConfig
from twinserve.simulator.copy_chain import CopyChain, one_rate, proposing_steps
from twinserve.traces.trace_request import stable_seed

PROFILE_FORMAT_VERSION = 3  # 2: the optional ``chain`` and ``draws``; 3: ``requests``
DRAWS = ("pooled", "chain", "requests")
MAX_REQUEST_UNITS = 2048  # units a profile keeps of a run (evenly spaced): its size stays bounded
_MASK64 = (1 << 64) - 1
_PROPOSAL_SALT, _LENGTH_SALT, _STATE_SALT = 0x5DEECE66D, 0x2545F4914F6CDD1D, 0x632BE59BD9B4E019
_UNIT_SALT = 0x7F4A7C159E3779B9
_SPAN = float(1 << 64)


def _uniform(key: int, position: int) -> float:
    """A uniform in [0, 1) from ``key`` and ``position`` (splitmix64's finaliser)."""
    z = (key + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) / _SPAN


def _length(mean: float, key: int, position: int) -> int:
    """A draft length of ``mean`` on average: the two whole numbers around it."""
    whole = int(mean)
    return whole + (_uniform(key ^ _LENGTH_SALT, position) < mean - whole)


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


_UNIT_COUNTS = ("span", "copy_length", "search_steps", "search_found", "search_found_tokens",
                "search_verified", "search_accepted")


@dataclass(frozen=True, slots=True)
class RequestUnit:
    """One measured request's speculation, drawn whole by a twin request (module doc): over the
    ``span`` output tokens its record covers, it searched until output offset ``onset`` (None:
    it never copied there), then copied ``copy_length`` drafts a step; its searching steps'
    counts give its own finding and acceptance."""

    span: int
    onset: int | None
    copy_length: int
    search_steps: int
    search_found: int
    search_found_tokens: int
    search_verified: int
    search_accepted: int

    def __post_init__(self) -> None:
        for name in _UNIT_COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RequestUnit.{name} must be an integer >= 0, got {value!r}.")
        if self.span < 1:
            raise ValueError(f"RequestUnit.span must be an integer >= 1, got {self.span!r}.")
        onset = self.onset
        if onset is not None and (isinstance(onset, bool) or not isinstance(onset, int)
                                  or not 0 <= onset < self.span):
            raise ValueError(f"RequestUnit.onset must be None or an integer in [0, span), got "
                             f"{onset!r}.")
        if (onset is None) != (self.copy_length == 0):
            raise ValueError(f"RequestUnit.copy_length must be > 0 exactly when onset is set, got "
                             f"{self.copy_length!r} with onset {onset!r}.")
        for part, whole in (("search_found", "search_steps"),
                            ("search_accepted", "search_verified")):
            if getattr(self, part) > getattr(self, whole):
                raise ValueError(f"RequestUnit.{part} ({getattr(self, part)}) exceeds {whole} "
                                 f"({getattr(self, whole)}).")

    def draws(self) -> tuple[int | None, int, float, float, float]:
        """(onset, copy length, proposal rate, draft length, per-position rate) while searching."""
        found, verified = self.search_found, self.search_verified
        rate = one_rate(found, verified, self.search_accepted) if found and verified else 0.0
        return (self.onset, self.copy_length,
                found / self.search_steps if self.search_steps else 0.0,
                max(1.0, self.search_found_tokens / found) if found else 1.0, rate)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_dict(cls, data: Any) -> RequestUnit:
        if not isinstance(data, dict) or set(data) != set(cls.__slots__):
            raise ValueError(f"an acceptance profile's 'requests' entries must be objects with "
                             f"the keys {list(cls.__slots__)}, got {data!r}.")
        return cls(**data)

    @classmethod
    def of(cls, rows: Sequence[DraftStep]) -> RequestUnit | None:
        """The unit of one request's ``drafts.csv`` rows in step order (None: no rows)."""
        if not rows:
            return None
        base = rows[0].position
        onset, lengths = None, Counter[int]()
        steps = found_steps = found_tokens = verified_tokens = accepted = 0
        for position, found, verified, state in proposing_steps(rows):
            if state:
                onset = position - base if onset is None else onset
                lengths[found] += 1
                continue
            steps += 1
            if verified is not None:
                found_steps, found_tokens = found_steps + 1, found_tokens + found
                verified_tokens += verified.num_drafts
                accepted += verified.num_accepted
        copy_length = max(lengths, key=lambda n: (lengths[n], n)) if lengths else 0
        return cls(max(1, rows[-1].position - base + 1), onset, copy_length, steps, found_steps,
                   found_tokens, verified_tokens, accepted)

    @classmethod
    def fit(cls, steps: Sequence[DraftStep],
            max_units: int = MAX_REQUEST_UNITS) -> tuple[RequestUnit, ...]:
        """The units of a run's ``drafts.csv`` rows, in the order of the requests' first rows;
        of a longer run, ``max_units`` evenly spaced ones, so a profile stays small."""
        by_request: dict[str, list[DraftStep]] = {}
        for step in steps:
            by_request.setdefault(step.request_id, []).append(step)
        units = [u for rows in by_request.values() if (u := cls.of(rows)) is not None]
        if len(units) > max_units:
            units = [units[i * len(units) // max_units] for i in range(max_units)]
        return tuple(units)


class AcceptanceModel:
    """Per-position conditional acceptance rates and seeded, counter-based draws (module doc);
    with a ``CopyChain``, each request's steps follow it instead of the pooled rates."""

    __slots__ = ("rates", "seed", "proposal_rate", "mean_draft_length", "chain", "units",
                 "_keys", "_chain_state", "_unit_state")

    def __init__(self, rates: Sequence[float], seed: int = 0, proposal_rate: float = 1.0,
                 mean_draft_length: float = 0.0, chain: CopyChain | None = None,
                 units: Sequence[RequestUnit] = ()) -> None:
        self.rates = _check_rates(rates, "acceptance rates")
        _check_proposals(proposal_rate, mean_draft_length)
        if chain is not None and units:
            raise ValueError("an AcceptanceModel draws from a chain or from units, not both.")
        self.seed = seed
        self.proposal_rate, self.mean_draft_length = float(proposal_rate), float(mean_draft_length)
        self.chain = chain
        self.units = tuple(u.draws() for u in units)  # each unit's parameters, computed once
        self._keys: dict[str, int] = {}  # request id -> its draw key (dropped with the request)
        # with a chain: request id -> (copying, proposing steps so far)
        self._chain_state: dict[str, tuple[bool, int]] = {}
        # with units: request id -> [its unit, its first proposal's position, copying, steps]
        self._unit_state: dict[str, list[int]] = {}

    @classmethod
    def of(cls, spec: SpeculativeConfig | None, seed: int = 0,
           profile: AcceptanceProfile | None = None) -> AcceptanceModel | None:
        """The model the twin runs (None: speculation off): ``profile``'s rates, or its chain
        when its ``draws`` say so, else the configuration's ``synthetic_acceptance_rate``."""
        if spec is None:
            return None
        if profile is not None:
            return cls(profile.rates, seed, profile.proposal_rate, profile.mean_draft_length,
                       profile.chain if profile.draws == "chain" else None,
                       profile.requests if profile.draws == "requests" else ())
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
        ``wanted``. With a chain: its state's (``CopyChain``)."""
        if self.chain is not None:
            return self._chain_proposed(request_id, position, wanted, self.chain)
        if self.units:
            return self._unit_proposed(request_id, position, wanted)
        if self.proposal_rate >= 1.0 and not self.mean_draft_length:
            return wanted
        key = self._key(request_id) ^ _PROPOSAL_SALT
        if _uniform(key, position) >= self.proposal_rate:
            return 0
        mean = self.mean_draft_length
        return min(wanted, _length(mean, key, position)) if mean else wanted

    def _chain_proposed(self, request_id: str, position: int, wanted: int,
                        chain: CopyChain) -> int:
        # keyed by the request's proposing step, not by ``position``: the twin proposes after
        # start + num_new_tokens, which repeats a position after a rejection, and a repeated
        # draw would make the chain stay where it failed to move (a biased rate)
        key = self._key(request_id) ^ _PROPOSAL_SALT
        copying, step = self._chain_state.get(request_id, (False, 0))
        stay = chain.p_copy_after_copy if copying else chain.p_copy_after_search
        copying = _uniform(key ^ _STATE_SALT, step) < stay
        self._chain_state[request_id] = (copying, step + 1)
        if copying:
            return min(wanted, chain.copy_length(_uniform(key ^ _STATE_SALT, -1)))
        if _uniform(key, step) >= chain.search_proposal_rate:
            return 0
        return min(wanted, _length(chain.search_draft_length, key, step))

    def _unit_proposed(self, request_id: str, position: int, wanted: int) -> int:
        # keyed by the request's proposing step, as the chain's (``_chain_proposed``); the onset
        # is counted in output tokens from the request's first proposal, as it was measured
        key = self._key(request_id) ^ _PROPOSAL_SALT
        state = self._unit_state.get(request_id)
        if state is None:
            unit = min(int(_uniform(key ^ _UNIT_SALT, 0) * len(self.units)), len(self.units) - 1)
            state = self._unit_state[request_id] = [unit, position, 0, 0]
        onset, copy_length, proposal_rate, draft_length, _ = self.units[state[0]]
        step = state[3]
        state[2] = int(onset is not None and position - state[1] >= onset)
        state[3] = step + 1
        if state[2]:
            return min(wanted, copy_length)
        if _uniform(key, step) >= proposal_rate:
            return 0
        return min(wanted, _length(draft_length, key, step))

    def num_accepted(self, request_id: str, position: int, num_drafts: int) -> int:
        """Accepted drafts of a verification of ``num_drafts`` whose first draft stands at
        token ``position`` of request ``request_id`` (all of them while the chain copies)."""
        chain = self.chain
        if chain is not None and self._chain_state.get(request_id, (False, 0))[0]:
            return num_drafts
        rates = self.rates if chain is None else chain.search_rates
        if self.units:
            state = self._unit_state.get(request_id)
            if state is not None and state[2]:
                return num_drafts
            rates = (self.units[state[0]][4],) if state is not None else rates
        last = len(rates) - 1
        key = self._key(request_id)
        for j in range(num_drafts):
            if _uniform(key, position + j) >= rates[j if j < last else last]:
                return j
        return num_drafts

    def release(self, request_id: str) -> None:
        self._keys.pop(request_id, None)
        self._chain_state.pop(request_id, None)
        self._unit_state.pop(request_id, None)

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
    chain: CopyChain | None = None  # measured from a run's drafts.csv (format version 2)
    draws: str = "pooled"  # what the twin draws from: "pooled" (the fields above), "chain", "requests"
    requests: tuple[RequestUnit, ...] = ()  # each request of a run's drafts.csv (version 3)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rates", _check_rates(self.rates, "AcceptanceProfile.rates"))
        _check_proposals(self.proposal_rate, self.mean_draft_length)
        if self.chain is not None and not isinstance(self.chain, CopyChain):
            raise ValueError(f"AcceptanceProfile.chain must be a CopyChain, got {self.chain!r}.")
        if self.draws not in DRAWS:
            raise ValueError(f"AcceptanceProfile.draws must be one of {DRAWS}, got {self.draws!r}.")
        if self.draws == "chain" and self.chain is None:
            raise ValueError("AcceptanceProfile.draws is 'chain' but the profile has no chain.")
        if isinstance(self.requests, (str, bytes)) or not isinstance(self.requests, Sequence) \
                or not all(isinstance(u, RequestUnit) for u in self.requests):
            raise ValueError(f"AcceptanceProfile.requests must be a list of RequestUnit, got "
                             f"{self.requests!r}.")
        object.__setattr__(self, "requests", tuple(self.requests))
        if self.draws == "requests" and not self.requests:
            raise ValueError("AcceptanceProfile.draws is 'requests' but the profile has none.")
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
        return cls(workload, (one_rate(num_drafts, num_draft_tokens, num_accepted_tokens),),
                   num_drafts, num_draft_tokens, num_accepted_tokens, (), source)

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
        data = {"format_version": PROFILE_FORMAT_VERSION, "workload": self.workload,
                "rates": list(self.rates), "proposal_rate": self.proposal_rate,
                "mean_draft_length": self.mean_draft_length, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos),
                "mean_acceptance_length": self.mean_acceptance_length, "source": self.source}
        if self.chain is not None:
            data["chain"] = self.chain.to_dict()
        if self.requests:
            data["requests"] = [u.to_dict() for u in self.requests]
        data["draws"] = self.draws
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AcceptanceProfile:
        """A profile of any format version up to this one's (a file without ``format_version``
        is version 1: no chain); a later version is refused, since its draws would differ."""
        if not isinstance(data, dict) or "rates" not in data:
            raise ValueError("an acceptance profile must be a JSON object with 'rates'.")
        version = data.get("format_version", 1)
        if isinstance(version, bool) or version not in range(1, PROFILE_FORMAT_VERSION + 1):
            raise ValueError(f"an acceptance profile's format_version must be 1 to "
                             f"{PROFILE_FORMAT_VERSION}, got {version!r}.")
        known = ("workload", "rates", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                 "accepted_per_pos", "source", "proposal_rate", "mean_draft_length")
        values = {k: data[k] for k in known if k in data}
        values.setdefault("workload", "")
        values["rates"] = tuple(values["rates"]) if isinstance(values["rates"], list) else values["rates"]
        values["accepted_per_pos"] = tuple(values.get("accepted_per_pos", ()))
        if data.get("chain") is not None:
            if version < 2:
                raise ValueError("an acceptance profile's 'chain' needs format_version 2.")
            values["chain"] = CopyChain.from_dict(data["chain"])
        if "draws" in data:
            if version < 2:
                raise ValueError("an acceptance profile's 'draws' needs format_version 2.")
            values["draws"] = data["draws"]
        if data.get("requests") is not None:
            units = data["requests"]
            if version < 3 or not isinstance(units, list):
                raise ValueError("an acceptance profile's 'requests' must be a list and needs "
                                 "format_version 3.")
            values["requests"] = tuple(RequestUnit.from_dict(u) for u in units)
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


__all__ = ["AcceptanceModel", "AcceptanceProfile", "CopyChain", "RequestUnit"]
