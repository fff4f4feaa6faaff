"""The speculation policies: registry, fixed k, and the adaptive rule against synthetic
step-time curves (flat: verification is free, so drafts pay; steep: each token costs as much
as a step, so they never do)."""

from __future__ import annotations

import pytest

from twinserve.core import SamplingParams
from twinserve.core.outputs import SchedulerOutput
from twinserve.core.request import Request
from twinserve.core.speculation import SpeculationPolicy
from twinserve.core.speculative_config import SpeculativeConfig
from twinserve.policies.speculation import (
    AdaptiveSpeculation,
    FixedSpeculation,
    get_speculation_policy,
    speculation_policy_for,
)
from twinserve.policies.speculation.adaptive import StepCurve


def req(rid: str = "a") -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=64), 0.0)


def feed(policy: AdaptiveSpeculation, curve, tokens=range(1, 300, 3)) -> None:
    for t in tokens:
        out = SchedulerOutput(total_num_scheduled_tokens=t)
        policy.on_step(out, 0.0, curve(t))


def test_registry_builds_fresh_instances_and_refuses_unknown_names():
    a, b = get_speculation_policy("adaptive", 4), get_speculation_policy("adaptive", 4)
    assert a is not b and isinstance(a, SpeculationPolicy)
    assert isinstance(get_speculation_policy("fixed", 3), FixedSpeculation)
    with pytest.raises(ValueError, match="unknown speculation policy 'nope'"):
        get_speculation_policy("nope", 4)
    with pytest.raises(ValueError, match="bad options"):
        get_speculation_policy("fixed", 4, bogus=1)
    policy = speculation_policy_for(SpeculativeConfig(num_speculative_tokens=3, policy="fixed",
                                                      disable_by_batch_size=8))
    assert isinstance(policy, FixedSpeculation) and policy.disable_by_batch_size == 8
    assert speculation_policy_for(None) is None


def test_fixed_gives_k_max_and_honours_disable_by_batch_size():
    policy = FixedSpeculation(4, disable_by_batch_size=8)
    assert policy.num_drafts(req(), 8, 100) == 4
    assert policy.num_drafts(req(), 9, 100) == 0
    assert policy.num_drafts(req(), 1, 2) == 2  # the budget bounds it


def test_step_curve_interpolates_and_extrapolates():
    curve = StepCurve()
    assert curve.seconds(10) is None
    curve.observe(10, 1.0)
    assert curve.seconds(50) == 1.0  # one point: flat
    curve.observe(20, 2.0)
    assert curve.seconds(15) == pytest.approx(1.5)
    assert curve.seconds(30) == pytest.approx(3.0)
    assert curve.seconds(5) == 1.0


def test_adaptive_drafts_when_verification_is_almost_free():
    policy = AdaptiveSpeculation(4, prior_acceptance=0.7)
    feed(policy, lambda t: 0.010 + 1e-6 * t)  # memory-bound: flat
    assert policy.num_drafts(req(), 1, 512) == 4


def test_adaptive_turns_off_when_each_token_costs_a_step():
    policy = AdaptiveSpeculation(4, prior_acceptance=0.7)
    feed(policy, lambda t: 0.001 * t)  # compute-bound from the first token
    policy.on_step(SchedulerOutput(total_num_scheduled_tokens=1), 0.0, 0.001)  # one decode ran
    assert policy.num_drafts(req(), 1, 512) == 0
    assert policy.num_drafts(req("b"), 1, 512) == 0


def test_adaptive_turns_off_for_large_batches():
    # a step is flat up to 64 tokens, then linear: a batch of 200 pays full price per draft
    policy = AdaptiveSpeculation(4, prior_acceptance=0.8)
    feed(policy, lambda t: 0.01 if t <= 64 else 0.01 * t / 64)
    policy.on_step(SchedulerOutput(total_num_scheduled_tokens=2), 0.0, 0.01)  # two decodes ran
    assert policy.num_drafts(req("small"), 2, 512) > 0
    policy.on_step(SchedulerOutput(total_num_scheduled_tokens=200), 0.0, 0.01 * 200 / 64)
    assert all(policy.num_drafts(req(f"r{i}"), 200, 512) == 0 for i in range(200))


def test_adaptive_stops_drafting_for_a_request_whose_drafts_are_rejected():
    policy = AdaptiveSpeculation(4, prior_acceptance=0.7)
    # each extra token costs a tenth of the fixed cost: drafts pay only if accepted often
    feed(policy, lambda t: 0.01 * (1 + 0.1 * t))
    policy.on_step(SchedulerOutput(total_num_scheduled_tokens=4), 0.0, 0.01 * 1.4)
    good, bad = req("good"), req("bad")
    assert policy.num_drafts(good, 4, 512) > 0
    for _ in range(30):
        bad.spec_num_drafts += 1
        policy.on_verified(bad, 4, 0)
        good.spec_num_accepted_tokens += 4
        policy.on_verified(good, 4, 4)
    policy.on_step(SchedulerOutput(total_num_scheduled_tokens=4), 0.0, 0.01 * 1.4)
    assert policy.acceptance(bad) < 0.2 < 0.8 < policy.acceptance(good)
    assert policy.num_drafts(bad, 4, 512) == 0
    assert policy.num_drafts(good, 4, 512) > 0


def test_adaptive_counts_displaced_prefill_tokens():
    """A step busy with a prompt chunk on a linear curve: drafts would take its time from
    prompt tokens, each worth a token, while a draft is worth less than one."""
    policy = AdaptiveSpeculation(4, prior_acceptance=0.9)
    feed(policy, lambda t: 0.005 + 1e-4 * t)
    policy.on_step(SchedulerOutput(total_num_scheduled_tokens=2), 0.0, 0.005 + 2e-4)
    assert policy.num_drafts(req("decode-only"), 2, 512) > 0  # the fixed cost dominates
    policy.on_step(SchedulerOutput(total_num_scheduled_tokens=2048), 0.0, 0.005 + 0.2048)
    assert policy.num_drafts(req("beside-prefill"), 2, 512) == 0


def test_adaptive_validates_its_options():
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveSpeculation(0)
    with pytest.raises(ValueError, match="margin"):
        AdaptiveSpeculation(2, margin=-1.0)
    with pytest.raises(ValueError, match="prior_acceptance"):
        AdaptiveSpeculation(2, prior_acceptance=1.5)


def test_adaptive_raises_a_fully_accepted_requests_k_up_to_the_cap_and_follows_the_match():
    policy = AdaptiveSpeculation(4, prior_acceptance=0.9, max_num_speculative_tokens=8)
    assert policy.k_max == 8 and policy.k_base == 4
    feed(policy, lambda t: 0.010 + 1e-6 * t)  # flat: every draft pays
    copying, other = req("copying"), req("other")
    assert policy.num_drafts(copying, 1, 512) == 4  # starts at the configured k
    policy.on_verified(copying, 2, 2)  # fewer drafts than its ceiling (a short match): no raise
    assert policy.num_drafts(copying, 1, 512) == 4
    policy.on_verified(copying, 4, 4)
    assert policy.num_drafts(copying, 1, 512) == 8
    assert policy.num_drafts(copying, 1, 6) == 6  # the budget still bounds it
    assert policy.num_drafts(other, 1, 512) == 4  # per request
    policy.on_verified(copying, 8, 8)
    assert policy.num_drafts(copying, 1, 512) == 8  # the cap
    policy.on_verified(copying, 8, 2)  # a rejection after 2: twice the 3 tokens the copy ran
    assert policy.ceiling(copying) == 6
    policy.on_verified(copying, 6, 5)  # after 5: 12, within the cap
    assert policy.ceiling(copying) == 8
    policy.on_verified(copying, 8, 0)  # rejected at once: back to the configured k
    assert policy.ceiling(copying) == 4 and policy.num_drafts(copying, 1, 512) <= 4


def test_adaptive_never_raises_k_without_a_cap_or_where_drafts_do_not_pay():
    plain = AdaptiveSpeculation(4, prior_acceptance=0.9)
    feed(plain, lambda t: 0.010 + 1e-6 * t)
    plain.on_verified(req(), 4, 4)
    assert plain.k_max == 4 and plain.num_drafts(req(), 1, 512) == 4
    steep = AdaptiveSpeculation(4, prior_acceptance=0.9, max_num_speculative_tokens=8)
    feed(steep, lambda t: 0.001 * t)
    steep.on_step(SchedulerOutput(total_num_scheduled_tokens=1), 0.0, 0.001)
    steep.on_verified(req(), 4, 4)
    assert steep.num_drafts(req(), 1, 512) == 0  # a raised ceiling is still only a ceiling


@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
def test_max_num_speculative_tokens_is_validated_by_name(policy):
    with pytest.raises(ValueError, match="max_num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=4, max_num_speculative_tokens=3, policy=policy)
    with pytest.raises(ValueError, match="max_num_speculative_tokens"):
        get_speculation_policy(policy, 4, max_num_speculative_tokens=2)
    config = SpeculativeConfig(num_speculative_tokens=4, max_num_speculative_tokens=8,
                               policy=policy)
    assert config.max_drafts == 8
    if policy == "fixed":  # vLLM's fixed k cannot use a higher cap: refused, not ignored
        with pytest.raises(ValueError, match="max_num_speculative_tokens"):
            speculation_policy_for(config)
    else:
        assert speculation_policy_for(config).k_max == 8
