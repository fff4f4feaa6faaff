"""Whole-request draws (``RequestUnit``, ``"draws": "requests"``): the fit reads each request's
onset of copying, copy length and searching counts; a twin request replays one drawn unit, so
the twin keeps the measured spread between requests (slow and fast ones) and their mean, where
pooled draws of the same mean give every request the same speed."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from tests.simulator.test_acceptance_chain import _drive, _spec
from twinserve.core.draft_record import DraftStep
from twinserve.simulator.acceptance import AcceptanceModel, AcceptanceProfile, RequestUnit

# a request that copies 4 drafts a step from output offset 2, and one that never copies and
# has its rare drafts mostly rejected
FAST = RequestUnit(span=200, onset=2, copy_length=4, search_steps=2, search_found=1,
                   search_found_tokens=2, search_verified=2, search_accepted=0)
SLOW = RequestUnit(span=200, onset=None, copy_length=0, search_steps=150, search_found=45,
                   search_found_tokens=90, search_verified=90, search_accepted=9)


def record(onset: int | None, num_steps: int, base: int = 16) -> list[DraftStep]:
    """One request's rows at k = 4: searching steps find 2 drafts every other step, none
    accepted; from ``onset`` (an output offset) on, each step finds and accepts 3."""
    rows, position, verified, accepted = [], base, 0, 0
    for _ in range(num_steps):
        copying = onset is not None and position - base >= onset
        found = 3 if copying else (2 if position % 2 else 0)
        rows.append(DraftStep("r", position, verified, accepted, 4, found))
        verified, accepted = found, found if copying else 0
        position += 1 + accepted
    return rows


@pytest.mark.parametrize("onset", [0, 5, 11, None])
def test_the_fit_reads_each_requests_onset_and_searching(onset):
    unit = RequestUnit.of(record(onset, 30))
    assert unit is not None
    # the record steps on every position while searching, on every fourth once copying
    assert unit.onset == (None if onset is None else pytest.approx(onset, abs=1))
    assert unit.copy_length == (0 if onset is None else 3)
    assert unit.search_accepted == 0 and unit.search_found <= unit.search_steps
    if onset is None:
        assert unit.search_steps == 29 and unit.search_found == 14  # the last one never verified


def _accepted_per_request(model: AcceptanceModel) -> list[float]:
    requests, _ = _drive(model, 120)
    return [r.spec_num_accepted_tokens / 120 for r in requests]


def test_unit_draws_keep_the_spread_and_the_mean_of_the_requests():
    units = AcceptanceProfile("w", (0.5,), requests=(FAST, SLOW), draws="requests")
    drawn = _accepted_per_request(AcceptanceModel.of(_spec(), 3, units))  # type: ignore[arg-type]
    fast, slow = [a for a in drawn if a > 0.5], [a for a in drawn if a <= 0.5]
    assert 0.4 < len(fast) / len(drawn) < 0.6  # each unit drawn about half the time
    # FAST accepts all of its 4 drafts a step from offset 2: 116 of 120 tokens less the last
    # step's clipped drafts; SLOW finds 2 drafts in 30% of its steps and accepts 0.2 of them a
    # verification (its rate r + r^2 = 9 / 45), 0.06 a step, ~6.8 of its 120 tokens
    assert statistics.mean(fast) == pytest.approx(0.77, abs=0.02) and min(fast) > 0.7
    assert statistics.mean(slow) == pytest.approx(6.8 / 120, abs=0.012) and max(slow) < 0.2
    # pooled draws of the same mean: every request near it, no slow or fast class
    share = statistics.mean(drawn)
    pooled = _accepted_per_request(AcceptanceModel((0.8,), 3, proposal_rate=share,
                                                   mean_draft_length=4.0))
    assert statistics.pstdev(drawn) > 4 * statistics.pstdev(pooled)


def test_the_schedulers_record_of_unit_draws_fits_back_to_the_units():
    model = AcceptanceModel((0.5,), seed=1, units=(FAST, SLOW))
    _, recorder = _drive(model, 120)
    fitted = RequestUnit.fit(recorder.steps)
    assert len(fitted) == 300
    copied = [u for u in fitted if u.onset is not None]
    assert 0.4 < len(copied) / len(fitted) < 0.6
    # a searching request with two full acceptances running reads as copying (the fit's rule)
    fast = [u for u in copied if u.copy_length == 4]
    assert len(fast) >= 0.97 * len(copied) and {u.onset for u in fast} == {FAST.onset}
    slow = [u for u in fitted if u.onset is None]
    found = sum(u.search_found for u in slow) / sum(u.search_steps for u in slow)
    assert found == pytest.approx(SLOW.search_found / SLOW.search_steps, abs=0.03)


def test_unit_draws_are_counter_based():
    def draws(order: list[str]) -> dict[str, list[tuple[int, int]]]:
        model = AcceptanceModel((0.5,), seed=5, units=(FAST, SLOW))
        seen: dict[str, list[tuple[int, int]]] = {}
        for step in range(40):
            for rid in order:
                found = model.num_proposed(rid, 10 + 5 * step, 4)
                seen.setdefault(rid, []).append((found, model.num_accepted(rid, 11 + 5 * step, 4)))
        return seen
    assert draws(["a", "b", "c", "d"]) == draws(["d", "c", "a", "b"])


def test_units_round_trip_and_are_drawn_only_where_the_profile_says_so(tmp_path):
    profile = AcceptanceProfile("w", (0.857,), proposal_rate=0.624, mean_draft_length=2.96,
                                requests=(FAST, SLOW))
    again = AcceptanceProfile.load(profile.save(tmp_path / "p.json"))
    assert again == profile and json.loads((tmp_path / "p.json").read_text())["format_version"] == 3
    assert not AcceptanceModel.of(_spec(), 7, again).units  # type: ignore[union-attr]
    drawn = AcceptanceModel.of(_spec(), 7, dataclasses.replace(again, draws="requests"))
    assert drawn is not None and len(drawn.units) == 2


UNIT = FAST.to_dict()


@pytest.mark.parametrize(("data", "field"), [
    ({"rates": [0.5], "format_version": 2, "requests": [UNIT]}, "format_version 3"),
    ({"rates": [0.5], "format_version": 3, "draws": "requests"}, "draws"),
    ({"rates": [0.5], "format_version": 3, "requests": {"a": UNIT}}, "requests"),
    ({"rates": [0.5], "format_version": 3, "requests": [{**UNIT, "onset": -1}]}, "onset"),
    ({"rates": [0.5], "format_version": 3, "requests": [{**UNIT, "onset": 200}]}, "onset"),
    ({"rates": [0.5], "format_version": 3, "requests": [{**UNIT, "copy_length": 0}]},
     "copy_length"),
    ({"rates": [0.5], "format_version": 3, "requests": [{**UNIT, "search_found": 3}]},
     "search_found"),
    ({"rates": [0.5], "format_version": 3, "requests": [{**UNIT, "search_accepted": 5}]},
     "search_accepted"),
    ({"rates": [0.5], "format_version": 3, "requests": [{**UNIT, "span": 1.5}]}, "span"),
    ({"rates": [0.5], "format_version": 3, "requests": [{**UNIT, "span": 0, "onset": None,
                                                         "copy_length": 0}]}, "span"),
    ({"rates": [0.5], "format_version": 3, "requests": [{**UNIT, "extra": 1}]}, "requests"),
    ({"rates": [0.5], "format_version": 4}, "format_version"),
])
def test_bad_units_are_refused_by_name(data, field):
    with pytest.raises(ValueError, match=field):
        AcceptanceProfile.from_dict(data)


def test_a_model_draws_from_a_chain_or_from_units_not_both():
    from tests.simulator.test_acceptance_chain import CHAIN
    with pytest.raises(ValueError, match="not both"):
        AcceptanceModel((0.5,), chain=CHAIN, units=(FAST,))


def test_a_long_runs_units_are_capped_evenly_spaced():
    rows = [dataclasses.replace(row, request_id=f"r{i}")
            for i in range(10) for row in record(None if i % 2 else i, 12)]
    every = RequestUnit.fit(rows)
    assert len(every) == 10
    kept = RequestUnit.fit(rows, max_units=4)
    assert kept == (every[0], every[2], every[5], every[7])
