"""Bursty acceptance: the two-state copy/search chain a real replay's drafts are fitted to, and
the one per-position rate that fits a set of verifications' totals (``one_rate``), which the
chain's searching steps, a request unit's and a profile without per-position counters use.

Bursty acceptance, measured (``CopyChain``; profile format version 2):

- Lookup proposers are bursty: a request that starts reproducing earlier text (its prompt, or
  its own loop) finds drafts every step and has them all accepted, usually to its end, while
  before that drafts come now and then and are mostly rejected. A real replay records each
  request's drafts step by step (``drafts.csv``, ``core.draft_record``) and its profile holds
  a two-state chain fitted on them. A proposing step is *copying* when its drafts were all
  accepted and so were the previous or the next step's (a lone full acceptance is chance),
  else *searching*. A request starts searching; each proposing step copies with
  ``p_copy_after_copy`` or ``p_copy_after_search`` by the previous one's state (so the onset
  of copying is geometric and requests differ in speed). A copying step finds the request's
  copy length (drawn once per request from ``copy_lengths``: a loop's period fixes it) and
  all of it is accepted; a searching step finds drafts with ``search_proposal_rate``,
  ``search_draft_length`` long, accepted per position with ``search_rates`` (one rate fitted
  to the searching verifications' totals).
- The twin draws from the chain only where the profile's ``draws`` is ``"chain"``. Held out
  between two workloads the chain did worse than pooled draws (``docs/speculative-decoding.md``,
  "Bursty acceptance"): when requests start copying is a property of the workload, which the
  pooled rates average away. It is kept as an explicit choice, with the record that made it
  measurable.
- Draws stay counter-based: a request's n-th proposing step copies iff ``u(request, n) < p``
  with the previous state's ``p``, so runs whose policies propose at the same steps see the
  same states; acceptance while searching is drawn per token position, as pooled draws are
  (``simulator.acceptance``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from twinserve.core.draft_record import DraftStep


def one_rate(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> float:
    """The one per-position rate that accepts the measured mean over the drafts' lengths
    (``simulator.acceptance``'s module doc)."""
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
    return round(hi, 6)


_PROBABILITIES = ("p_copy_after_copy", "p_copy_after_search", "search_proposal_rate")
_LENGTHS = ("search_draft_length",)
_COUNTS = ("num_requests", "num_transitions")


def _number(value: Any, name: str, low: float, high: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low \
            or (high is not None and value > high):
        bounds = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise ValueError(f"CopyChain.{name} must be a number {bounds}, got {value!r}.")
    return float(value)


@dataclass(frozen=True, slots=True)
class CopyChain:
    """The two-state chain's parameters and the counts they came from (module doc)."""

    p_copy_after_copy: float
    p_copy_after_search: float
    copy_lengths: tuple[float, ...]  # [j]: the share of copying requests that copy j + 1 drafts
    search_proposal_rate: float
    search_draft_length: float
    search_rates: tuple[float, ...]
    num_requests: int = 0
    num_transitions: int = 0

    def __post_init__(self) -> None:
        for name in _PROBABILITIES:
            object.__setattr__(self, name, _number(getattr(self, name), name, 0.0, 1.0))
        for name in _LENGTHS:
            object.__setattr__(self, name, _number(getattr(self, name), name, 1.0, None))
        for name in ("copy_lengths", "search_rates"):
            values = getattr(self, name)
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
                raise ValueError(f"CopyChain.{name} must be a non-empty list, got {values!r}.")
            object.__setattr__(self, name, tuple(_number(v, name, 0.0, 1.0) for v in values))
        if abs(sum(self.copy_lengths) - 1.0) > 1e-3:
            raise ValueError(f"CopyChain.copy_lengths must sum to 1, got {self.copy_lengths!r}.")
        for name in _COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"CopyChain.{name} must be an integer >= 0, got {value!r}.")

    def copy_length(self, u: float) -> int:
        """The copy length whose cumulative share first exceeds ``u`` in [0, 1)."""
        total = 0.0
        for j, share in enumerate(self.copy_lengths):
            total += share
            if u < total:
                return j + 1
        return len(self.copy_lengths)

    def to_dict(self) -> dict[str, Any]:
        return {name: list(value) if isinstance(value, tuple) else value
                for name in self.__slots__ for value in (getattr(self, name),)}

    @classmethod
    def from_dict(cls, data: Any) -> CopyChain:
        if not isinstance(data, dict):
            raise ValueError(f"an acceptance profile's 'chain' must be an object, got {data!r}.")
        unknown = sorted(set(data) - set(cls.__slots__))
        if unknown:
            raise ValueError(f"an acceptance profile's 'chain' has unknown keys {unknown}.")
        try:
            return cls(**data)
        except TypeError as exc:  # a missing key
            raise ValueError(f"an acceptance profile's 'chain' is incomplete: {exc}") from None

    @classmethod
    def fit(cls, steps: Sequence[DraftStep]) -> CopyChain | None:
        """The chain of a run's ``drafts.csv`` rows, in step order (module doc); None where no
        request copied for two steps running, or none searched (nothing to fit)."""
        by_request: dict[str, list[DraftStep]] = {}
        for step in steps:
            by_request.setdefault(step.request_id, []).append(step)
        tally = _Tally()
        for rows in by_request.values():
            tally.add_request(rows)
        return tally.chain(len(by_request))


def proposing_steps(rows: Sequence[DraftStep]
                     ) -> list[tuple[int, int, DraftStep | None, int]]:
    """A request's proposing steps whose state is observable, in step order: (position, drafts
    found, their verification or None, state: 1 copying, 0 searching). A step that found
    drafts never verified (the request ended) has no state and is left out (module doc)."""
    seen: list[tuple[int, int, DraftStep | None]] = []
    for i, row in enumerate(rows):
        if not row.num_asked:
            continue
        verified = rows[i + 1] if i + 1 < len(rows) else None
        if row.num_found and (verified is None or not verified.num_drafts):
            continue
        seen.append((row.position, row.num_found, verified if row.num_found else None))
    full = [v is not None and v.num_accepted == v.num_drafts for _, _, v in seen]
    # copying: in a run of two or more full acceptances (a lone one is chance)
    return [(position, found, verified,
             int(full[j] and (j > 0 and full[j - 1] or j + 1 < len(full) and full[j + 1])))
            for j, (position, found, verified) in enumerate(seen)]


@dataclass(slots=True)
class _Tally:
    """Counts over the proposing steps of a run (``CopyChain.fit``)."""

    # transitions[previous][now], states: 0 searching, 1 copying
    transitions: list[list[int]] = field(default_factory=lambda: [[0, 0], [0, 0]])
    copy_lengths: Counter[int] = field(default_factory=Counter)  # requests by copy length
    search_found: int = 0
    search_found_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0

    def add_request(self, rows: list[DraftStep]) -> None:
        previous, lengths = 0, Counter[int]()
        for _, found, verified, state in proposing_steps(rows):
            if state:
                lengths[found] += 1
            elif verified is not None:
                self.search_found += 1
                self.search_found_tokens += found
                self.verified_tokens += verified.num_drafts
                self.accepted_tokens += verified.num_accepted
            self.transitions[previous][state] += 1
            previous = state
        if lengths:  # the request's most frequent copy length (ties: the longer)
            self.copy_lengths[max(lengths, key=lambda n: (lengths[n], n))] += 1

    def chain(self, num_requests: int) -> CopyChain | None:
        (ss, sc), (cs, cc) = self.transitions
        if not (cc + cs) or not (ss + sc):
            return None
        rate = (one_rate(self.search_found, self.verified_tokens, self.accepted_tokens)
                if self.verified_tokens else 0.0)
        searching = ss + cs  # steps in the searching state
        copying = sum(self.copy_lengths.values())  # requests that copied
        return CopyChain(
            p_copy_after_copy=round(cc / (cc + cs), 6), p_copy_after_search=round(sc / (ss + sc), 6),
            copy_lengths=tuple(round(self.copy_lengths[n] / copying, 6)
                               for n in range(1, max(self.copy_lengths) + 1)),
            search_proposal_rate=round(self.search_found / searching, 6),
            search_draft_length=round(self.search_found_tokens / self.search_found, 4)
            if self.search_found else 1.0,
            search_rates=(rate,), num_requests=num_requests, num_transitions=ss + sc + cs + cc)


__all__ = ["CopyChain", "one_rate", "proposing_steps"]
