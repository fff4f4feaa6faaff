"""Rejection sampling preserves the target distribution: on a 4-token vocabulary the first and
second emitted tokens' frequencies agree with the target's probabilities by a chi-square test at
significance 0.001 (3 degrees of freedom: critical value 16.266, tabulated), and the same test
rejects wrong acceptance rules (always accept; the argmax for a sampled request)."""

from __future__ import annotations

import pytest
import torch

from twinserve.gpu.worker.rejection_sampler import VerifySettings, verify

CRITICAL_3DF_0_001 = 16.266
TRIALS = 3000
TARGET = torch.tensor([0.5, 0.25, 0.15, 0.10])
DRAFT = torch.tensor([0.1, 0.2, 0.6, 0.1])  # far from the target: many rejections


def _chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def _run(settings: VerifySettings, draft_kind: str, pass_probs: bool) -> tuple[list[int], list[int]]:
    """First and second emitted tokens over TRIALS verifications of 2 drafts."""
    gen = torch.Generator().manual_seed(1234)
    probs = TARGET.expand(3, -1).clone()
    logits = probs.log()
    firsts, seconds = [], []
    for _ in range(TRIALS):
        if draft_kind == "one-hot":
            drafts, q = [0, 0], None  # a lookup proposing the target's likeliest token
        else:
            drafts = torch.multinomial(DRAFT, 2, replacement=True, generator=gen).tolist()
            q = DRAFT.expand(2, -1).clone()
        tokens = verify(settings, False, drafts, logits, probs, q if pass_probs else None, gen)
        firsts.append(tokens[0])
        if len(tokens) > 1:
            seconds.append(tokens[1])
    return firsts, seconds


@pytest.mark.parametrize("draft_kind", ["one-hot", "draft-model"])
def test_probabilistic_rejection_sampling_preserves_the_target(draft_kind):
    firsts, seconds = _run(VerifySettings("probabilistic"), draft_kind, pass_probs=True)
    assert len(seconds) > TRIALS // 10
    assert _chi_square(firsts, TARGET) < CRITICAL_3DF_0_001
    assert _chi_square(seconds, TARGET) < CRITICAL_3DF_0_001


@pytest.mark.parametrize("draft_kind", ["one-hot", "draft-model"])
def test_the_test_rejects_always_accepting(draft_kind):
    firsts, _ = _run(VerifySettings("synthetic", (1.0,)), draft_kind, pass_probs=True)
    assert _chi_square(firsts, TARGET) > CRITICAL_3DF_0_001


def test_one_hot_verification_of_sampled_drafts_is_also_exact():
    """Accepting with p(d) and drawing from p without d preserves p whatever drew d (the draft
    is conditioned on), at a lower acceptance than min(1, p/q)."""
    firsts, seconds = _run(VerifySettings("probabilistic"), "draft-model", pass_probs=False)
    _, seconds_q = _run(VerifySettings("probabilistic"), "draft-model", pass_probs=True)
    assert _chi_square(firsts, TARGET) < CRITICAL_3DF_0_001
    assert len(seconds) < len(seconds_q)


def test_the_test_rejects_verifying_a_sampled_request_greedily():
    gen = torch.Generator().manual_seed(5)
    probs = TARGET.expand(2, -1).clone()
    firsts = [verify(VerifySettings("probabilistic"), True, [1], probs.log(), probs, None, gen)[0]
              for _ in range(TRIALS)]
    assert _chi_square(firsts, TARGET) > CRITICAL_3DF_0_001


def test_strict_and_greedy_accept_while_the_draft_is_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    gen = torch.Generator().manual_seed(0)
    assert verify(VerifySettings("strict"), True, [1, 0], logits, None, None, gen) == [1, 0, 2]
    assert verify(VerifySettings("probabilistic"), True, [1, 2], logits, None, None, gen) == [1, 0]
    assert verify(VerifySettings("strict"), True, [2, 0], logits, None, None, gen) == [1]


def test_synthetic_rates_give_the_acceptance_asked_for():
    gen = torch.Generator().manual_seed(7)
    logits = torch.zeros(4, 5)
    lengths = [len(verify(VerifySettings("synthetic", (0.5,)), True, [1, 1, 1], logits, None,
                          None, gen)) - 1 for _ in range(4000)]
    # E[accepted] = 0.5 + 0.25 + 0.125
    assert sum(lengths) / len(lengths) == pytest.approx(0.875, abs=0.05)


@pytest.mark.parametrize("kwargs, field", [(dict(method="eagle"), "rejection_sample_method"),
                                           (dict(method="synthetic"), "synthetic_acceptance_rate"),
                                           (dict(method="synthetic",
                                                 synthetic_acceptance_rate=(1.5,)),
                                            "synthetic_acceptance_rate")])
def test_settings_refuse_bad_values_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        VerifySettings(**kwargs)
