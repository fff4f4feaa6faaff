"""Bursty acceptance (``CopyChain``): the fit recovers a known chain from per-step records, the
twin's draws from a chain persist where pooled draws do not, the shared scheduler's own record
of a chained twin fits back to its chain, and profiles written before the chain load and draw
exactly as they did."""

from __future__ import annotations

import json
import random

import pytest

from twinserve.core import SamplingParams, SchedulerConfig
from twinserve.core.draft_record import DraftRecorder, DraftStep
from twinserve.core.request import Request
from twinserve.core.scheduler import Scheduler
from twinserve.policies import get_policy
from twinserve.policies.speculation import FixedSpeculation
from twinserve.simulator.acceptance import AcceptanceModel, AcceptanceProfile, CopyChain
from twinserve.simulator.engine import SyntheticTokens

CHAIN = CopyChain(p_copy_after_copy=0.95, p_copy_after_search=0.1,
                  copy_lengths=(0.0, 0.25, 0.25, 0.5), search_proposal_rate=0.4,
                  search_draft_length=2.0, search_rates=(0.3,))

# Draws of the pooled model, recorded before the chain existed (profile format version 1).
OLD_PROFILE = {"workload": "w", "rates": [0.857], "proposal_rate": 0.624,
               "mean_draft_length": 2.96, "request_groups": [[0.4, 0.9, 0.0]]}
OLD_PROPOSED = [0, 0, 3, 0, 0, 0, 0, 0, 0, 3, 3, 3, 0, 0, 0, 0, 3, 3, 3, 0, 0, 3, 3, 3, 0, 0, 2, 3,
                0, 3, 3, 3]
OLD_ACCEPTED = [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 3, 2, 1, 0, 4, 4, 4, 4,
                4, 4, 4, 3]


def synthetic_record(num_requests: int, num_steps: int, seed: int) -> list[DraftStep]:
    """Per-step records of requests that follow ``CHAIN`` (k = 4): a searching verification
    accepts none of its drafts, so only the chain's copying steps are fully accepted."""
    rng, rows = random.Random(seed), []
    for r in range(num_requests):
        length = rng.choices(range(1, 5), CHAIN.copy_lengths)[0]
        found, copying = 0, False
        for position in range(num_steps):
            verified, accepted = found, found if copying else 0  # the previous proposal's
            stay = CHAIN.p_copy_after_copy if copying else CHAIN.p_copy_after_search
            copying = rng.random() < stay
            found = length if copying else (2 if rng.random() < CHAIN.search_proposal_rate else 0)
            rows.append(DraftStep(f"r{r}", position, verified, accepted, 4, found))
    return rows


def test_the_fit_recovers_a_known_chain():
    fitted = CopyChain.fit(synthetic_record(400, 40, seed=3))
    assert fitted is not None and fitted.num_requests == 400
    # a copying run of one step reads as a lone full acceptance (searching): a ~5% bias down
    assert fitted.p_copy_after_copy == pytest.approx(CHAIN.p_copy_after_copy, abs=0.01)
    assert fitted.p_copy_after_search == pytest.approx(CHAIN.p_copy_after_search, abs=0.01)
    assert fitted.copy_lengths == pytest.approx(CHAIN.copy_lengths, abs=0.06)
    assert fitted.search_proposal_rate == pytest.approx(CHAIN.search_proposal_rate, abs=0.02)
    assert fitted.search_draft_length == pytest.approx(2.0, abs=0.05)
    assert fitted.search_rates[0] < 0.1  # only the lone copying steps were accepted


def test_no_copying_gives_no_chain():
    rows = [DraftStep("r", p, 2 if p % 2 else 0, 1 if p % 2 else 0, 4, 0 if p % 2 else 2)
            for p in range(30)]
    assert CopyChain.fit(rows) is None


def _found_runs(model: AcceptanceModel, num_requests: int, num_steps: int) -> tuple[float, float]:
    """(share of steps that found drafts, the mean length of the run of such steps that a step
    which found drafts belongs to) as the twin calls the model: a proposal after each step, its
    verification in the next. Weighting runs by their steps counts bursts, not their number."""
    found_steps, runs = 0, []
    for r in range(num_requests):
        rid, position, drafts, run = f"q{r}", 100, 0, 0
        for _ in range(num_steps):
            accepted = model.num_accepted(rid, position + 1, drafts) if drafts else 0
            position += 1 + accepted
            drafts = model.num_proposed(rid, position, 4)
            found_steps += drafts > 0
            if drafts:
                run += 1
            elif run:
                runs.append(run)
                run = 0
        runs.append(run)
        model.release(rid)
    return found_steps / (num_requests * num_steps), sum(n * n for n in runs) / sum(runs)


def test_a_persistent_chain_finds_drafts_in_longer_runs_than_pooled_draws():
    chained = AcceptanceModel((0.5,), seed=1, chain=CHAIN)
    share, chained_runs = _found_runs(chained, 200, 100)
    pooled = AcceptanceModel((0.5,), seed=1, proposal_rate=share, mean_draft_length=3.0)
    pooled_share, pooled_runs = _found_runs(pooled, 200, 100)
    assert pooled_share == pytest.approx(share, abs=0.02)  # the same mean rate
    assert chained_runs > 3 * pooled_runs


def test_chain_draws_are_counter_based():
    """A request's draws depend on its id and positions only, not on the other requests."""
    def draws(order: list[str]) -> dict[str, list[tuple[int, int]]]:
        model, seen = AcceptanceModel((0.5,), seed=5, chain=CHAIN), {}
        for step in range(40):
            for rid in order:
                found = model.num_proposed(rid, 10 + 5 * step, 4)
                seen.setdefault(rid, []).append((found, model.num_accepted(rid, 11 + 5 * step, 4)))
        return seen
    assert draws(["a", "b", "c"]) == draws(["c", "a", "b"])


def test_copying_steps_are_accepted_whole():
    model = AcceptanceModel((0.0,), seed=2, chain=CopyChain(1.0, 1.0, (0.0, 0.0, 1.0), 0.0, 1.0,
                                                            (0.0,)))
    assert [model.num_proposed("r", p, 4) for p in range(5)] == [3] * 5
    assert model.num_accepted("r", 9, 3) == 3
    assert model.num_proposed("r", 20, 2) == 2  # never more than asked


def _drive(model: AcceptanceModel, max_tokens: int) -> tuple[list[Request], DraftRecorder]:
    """300 requests through the shared scheduler at k = 4 on the twin's tokens drawn from
    ``model``, every step recorded as the real engine records it."""
    config = SchedulerConfig(num_gpu_blocks=4096, block_size=16, max_num_seqs=64,
                             max_num_batched_tokens=4096, max_model_len=512,
                             num_speculative_tokens=4)
    sched = Scheduler(config, get_policy("fcfs"), speculation=FixedSpeculation(4))
    backend, recorder = SyntheticTokens(model), DraftRecorder()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [Request(f"r{i}", [7] * 16, params, 0.0) for i in range(300)]
    for request in requests:
        sched.add_request(request)
    now = 0.0
    while sched.has_unfinished_requests():
        out = sched.schedule(now)
        result = backend.execute(out)
        now += 0.01
        sched.update_from_output(out, result, now)
        recorder.on_step(out, 0.01, 0.01)
    return requests, recorder


def test_the_schedulers_record_of_a_chained_twin_fits_back_to_its_chain():
    requests, recorder = _drive(AcceptanceModel((0.3,), seed=4, chain=CHAIN), 200)
    for request in requests[:20]:  # the record adds up to the request's counters
        rows = [s for s in recorder.steps if s.request_id == request.request_id]
        assert sum(s.num_drafts > 0 for s in rows) == request.spec_num_drafts
        assert sum(s.num_drafts for s in rows) == request.spec_num_draft_tokens
        assert sum(s.num_accepted for s in rows) == request.spec_num_accepted_tokens
    fitted = CopyChain.fit(recorder.steps)
    assert fitted is not None
    assert fitted.p_copy_after_copy == pytest.approx(CHAIN.p_copy_after_copy, abs=0.015)
    assert fitted.p_copy_after_search == pytest.approx(CHAIN.p_copy_after_search, abs=0.015)
    assert fitted.search_proposal_rate == pytest.approx(CHAIN.search_proposal_rate, abs=0.03)


def test_old_profiles_load_and_draw_exactly_as_before(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(OLD_PROFILE))
    profile = AcceptanceProfile.load(path)
    assert profile.chain is None and profile.draws == "pooled"
    model = AcceptanceModel.of(_spec(), 7, profile)
    assert model is not None and model.chain is None
    assert [model.num_proposed("r-1", p, 4) for p in range(64, 96)] == OLD_PROPOSED
    assert [model.num_accepted("r-1", p, 4) for p in range(64, 96)] == OLD_ACCEPTED
    again = AcceptanceProfile.load(profile.save(tmp_path / "again.json"))
    assert again == profile and json.loads((tmp_path / "again.json").read_text())[
        "format_version"] == 3


def test_a_measured_chain_is_drawn_only_where_the_profile_says_so(tmp_path):
    pooled = AcceptanceProfile("w", (0.857,), proposal_rate=0.624, mean_draft_length=2.96,
                               chain=CHAIN)
    model = AcceptanceModel.of(_spec(), 7, AcceptanceProfile.load(pooled.save(tmp_path / "p.json")))
    assert model is not None and model.chain is None
    assert [model.num_proposed("r-1", p, 4) for p in range(64, 96)] == OLD_PROPOSED
    chained = AcceptanceProfile.load(
        AcceptanceProfile("w", (0.857,), chain=CHAIN, draws="chain").save(tmp_path / "c.json"))
    assert chained.chain == CHAIN
    model = AcceptanceModel.of(_spec(), 7, chained)
    assert model is not None and model.chain == CHAIN


@pytest.mark.parametrize(("data", "field"), [
    ({"rates": [0.5], "format_version": 4}, "format_version"),
    ({"rates": [0.5], "chain": CHAIN.to_dict()}, "chain"),  # a chain needs version 2
    ({"rates": [0.5], "format_version": 2, "draws": "chain"}, "draws"),
    ({"rates": [0.5], "format_version": 2, "draws": "bursty"}, "draws"),
    ({"rates": [0.5], "format_version": 2,
      "chain": {**CHAIN.to_dict(), "p_copy_after_copy": 1.5}}, "p_copy_after_copy"),
    ({"rates": [0.5], "format_version": 2,
      "chain": {**CHAIN.to_dict(), "copy_lengths": [0.5, 0.2]}}, "copy_lengths"),
    ({"rates": [0.5], "format_version": 2, "chain": {"p_copy_after_copy": 0.5}}, "chain"),
    ({"rates": [0.5], "format_version": 2, "chain": {**CHAIN.to_dict(), "extra": 1}}, "chain"),
])
def test_bad_profiles_are_refused_by_name(data, field):
    with pytest.raises(ValueError, match=field):
        AcceptanceProfile.from_dict(data)


def _spec():
    from twinserve.core.speculative_config import SpeculativeConfig
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})


@pytest.mark.parametrize("rate", [0.3, 0.624])
def test_pooled_draws_find_drafts_at_the_profiles_rate(rate):
    """The twin asks for each proposal at the newest token's position after the rollback: keyed
    by a position rejected drafts had counted, a step after a rejection re-drew the key of the
    one before it, and the twin found drafts a few points below the profile's rate."""
    _, recorder = _drive(AcceptanceModel((0.5,), seed=3, proposal_rate=rate,
                                         mean_draft_length=3.0), 120)
    asked = [s for s in recorder.steps if s.num_asked]
    share = sum(s.num_found > 0 for s in asked) / len(asked)
    assert len(asked) > 10_000
    assert share == pytest.approx(rate, abs=0.01)
