"""One acceptance profile from several measured ones: the twin of a workload none of them was
measured on replays what a mix of workloads accepted.

Decisions:

- Counters add up: verifications, drafted and accepted tokens, and vLLM's per-position counts
  where every source has them for the same positions and proposed whole drafts (then the rates
  are exact, as for one run); otherwise one rate fitted to the summed totals, as for a run
  without per-position counters.
- The proposal rate is verifications over the steps that could verify, summed over sources
  (each source's steps are its verifications over its rate), so a source weighs by its steps.
- Request units are pooled, each source's in turn (at most ``MAX_REQUEST_UNITS``, evenly
  spaced); a twin request draws one of any source. A copy/search chain is not merged (it is
  fitted on steps the profiles no longer hold); the merged profile has none.
- The draws follow the sources where they agree ("pooled" or "requests"); sources that differ,
  or a "chain" source, are refused with the names of what they say, since the twin would
  otherwise draw otherwise than one of them asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from twinserve.simulator.acceptance import MAX_REQUEST_UNITS, AcceptanceProfile


def merge_profiles(profiles: Sequence[AcceptanceProfile]) -> AcceptanceProfile:
    """The profile of ``profiles`` measured together (module doc); one profile is returned as is."""
    if not profiles:
        raise ValueError("merging acceptance profiles needs at least one profile.")
    if len(profiles) == 1:
        return profiles[0]
    draws = {p.draws for p in profiles}
    if len(draws) > 1 or "chain" in draws:
        raise ValueError(f"acceptance profiles to merge must all draw 'pooled' or all "
                         f"'requests', got {sorted(draws)}: set 'draws' in the files to agree.")
    drafts = sum(p.num_drafts for p in profiles)
    tokens = sum(p.num_draft_tokens for p in profiles)
    accepted = sum(p.num_accepted_tokens for p in profiles)
    if not drafts or not tokens:
        raise ValueError("acceptance profiles to merge must hold measured counters "
                         "(num_drafts and num_draft_tokens > 0).")
    name = " + ".join(p.workload or "unnamed" for p in profiles)
    source = " + ".join(p.source for p in profiles if p.source)
    positions = {len(p.accepted_per_pos) for p in profiles}
    whole = all(p.mean_draft_length == 0.0 for p in profiles)
    if whole and len(positions) == 1 and 0 not in positions:
        per_pos = [sum(col) for col in zip(*(p.accepted_per_pos for p in profiles))]
        base = AcceptanceProfile.from_counts(name, drafts, per_pos, tokens, source)
    else:
        base = AcceptanceProfile.from_totals(name, drafts, tokens, accepted, source)
    chances = sum(p.num_drafts / p.proposal_rate for p in profiles if p.proposal_rate > 0)
    units = [u for p in profiles for u in p.requests]
    if len(units) > MAX_REQUEST_UNITS:
        units = [units[i * len(units) // MAX_REQUEST_UNITS] for i in range(MAX_REQUEST_UNITS)]
    return AcceptanceProfile(
        name, base.rates, drafts, tokens, accepted, base.accepted_per_pos, source,
        proposal_rate=min(1.0, drafts / chances) if chances else 1.0,
        mean_draft_length=0.0 if whole else round(tokens / drafts, 4),
        draws=draws.pop(), requests=tuple(units))


def load_profiles(paths: Sequence[str | Path]) -> AcceptanceProfile:
    """The profile of the files ``paths`` (one file: that profile; several: merged)."""
    return merge_profiles([AcceptanceProfile.load(p) for p in paths])


__all__ = ["load_profiles", "merge_profiles"]
