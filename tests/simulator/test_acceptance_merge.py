"""Merging measured acceptance profiles (``simulator/acceptance_merge.py``): counters add up,
the proposal rate weighs each source by its steps, units pool, and mixed draws are refused."""

from __future__ import annotations

import dataclasses

import pytest

from twinserve.simulator.acceptance import AcceptanceProfile, CopyChain, RequestUnit
from twinserve.simulator.acceptance_merge import load_profiles, merge_profiles


def _profile(name: str, drafts: int, per_pos: tuple[int, ...], proposal_rate: float,
             **extra: object) -> AcceptanceProfile:
    base = AcceptanceProfile.from_counts(name, drafts, per_pos, drafts * len(per_pos), name)
    return dataclasses.replace(base, proposal_rate=proposal_rate, **extra)


def _chain() -> CopyChain:
    return CopyChain(p_copy_after_copy=0.9, p_copy_after_search=0.1, copy_lengths=(0.0, 1.0),
                     search_proposal_rate=0.5, search_draft_length=2.0, search_rates=(0.5,),
                     num_requests=4, num_transitions=40)


def _unit(onset: int | None) -> RequestUnit:
    return RequestUnit(40, onset, 0 if onset is None else 3, 10, 5, 10, 10, 4)


def test_counters_add_up_and_give_the_rates_of_one_run():
    a = _profile("a", 100, (80, 60, 40, 20), 0.5)
    b = _profile("b", 300, (150, 90, 45, 15), 0.75)
    merged = merge_profiles([a, b])
    together = AcceptanceProfile.from_counts("x", 400, (230, 150, 85, 35), 1600)
    assert merged.rates == together.rates
    assert (merged.num_drafts, merged.num_draft_tokens, merged.num_accepted_tokens) == \
        (400, 1600, 230 + 150 + 85 + 35)
    # a's 100 verifications came from 200 steps, b's 300 from 400: 400 of 600
    assert merged.proposal_rate == pytest.approx(400 / 600)
    assert merged.workload == "a + b" and merged.mean_draft_length == 0.0


def test_short_drafts_or_other_positions_fall_back_to_one_rate_on_the_totals():
    a = _profile("a", 100, (80, 60, 40, 20), 0.5)
    b = dataclasses.replace(_profile("b", 100, (50, 20), 0.5), mean_draft_length=2.0)
    merged = merge_profiles([a, b])
    fitted = AcceptanceProfile.from_totals("x", 200, 600, 270)
    assert merged.rates == fitted.rates and len(merged.rates) == 1
    assert merged.mean_draft_length == 3.0


def test_units_pool_and_keep_the_draws_the_sources_agree_on(tmp_path):
    a = _profile("a", 100, (80, 60), 0.5, requests=(_unit(3), _unit(None)), draws="requests")
    b = _profile("b", 100, (50, 20), 0.5, requests=(_unit(7),), draws="requests")
    paths = [a.save(tmp_path / "a.json"), b.save(tmp_path / "b.json")]
    merged = load_profiles(paths)
    assert merged.draws == "requests"
    assert [u.onset for u in merged.requests] == [3, None, 7]
    assert load_profiles(paths[:1]) == AcceptanceProfile.load(paths[0])


def test_mixed_draws_are_refused():
    a = _profile("a", 100, (80, 60), 0.5, requests=(_unit(3),), draws="requests")
    b = _profile("b", 100, (50, 20), 0.5, requests=(_unit(5),))
    with pytest.raises(ValueError, match="all draw 'pooled' or all 'requests', got"):
        merge_profiles([a, b])


def test_nothing_merges_from_nothing_or_from_a_chain():
    with pytest.raises(ValueError, match="at least one"):
        merge_profiles([])
    steps = _profile("a", 100, (80, 60), 0.5)
    chained = dataclasses.replace(steps, chain=_chain(), draws="chain")
    with pytest.raises(ValueError, match="'chain'"):
        merge_profiles([chained, steps])
