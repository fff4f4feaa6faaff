"""The offline step count of ``benchmarks/spec_replay``: greedy verification replayed without
a model."""

from __future__ import annotations

import pytest

from twinserve.benchmarks.spec_prompts import DEFAULT_PROMPT_SET, V1_TEXTS, Prompt, prompt_set
from twinserve.benchmarks.spec_replay import (
    Ceiling,
    Replayed,
    copied_share,
    count_steps,
    oracle_draft,
    replay,
)
from twinserve.spec_decode.ngram import NgramProposer


def _never(_: str, tokens: list[int], k: int) -> list[int]:
    return []


def test_replay_counts_one_step_per_token_without_drafts_and_fewer_with_right_ones():
    prompt, output = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]
    assert replay(_never, "r", prompt, output, Ceiling(4, 4)) == Replayed(7, 0)  # after the first
    # the oracle copies 4 a step: 2..5, 6..8 plus the model's token each time
    assert replay(oracle_draft(output, len(prompt)), "r", prompt, output, Ceiling(4, 4)) == Replayed(2, 2)
    assert replay(_never, "r", prompt, [9], Ceiling(4, 4)) == Replayed(0, 0)


def test_replay_stops_acceptance_at_the_first_wrong_draft():
    def wrong_second(_: str, tokens: list[int], k: int) -> list[int]:
        return [tokens[-1] + 1, -1][:k]
    # each step accepts one draft and adds the model's token: 2 tokens a step
    assert replay(wrong_second, "r", [0], [1, 2, 3, 4, 5], Ceiling(4, 4)) == Replayed(2, 2)


def test_the_ceiling_doubles_on_full_acceptance_and_follows_the_match_on_a_rejection():
    ceiling = Ceiling(2, 8)
    assert ceiling.next(2, 2, 2) == 4
    assert ceiling.next(4, 4, 4) == 8
    assert ceiling.next(8, 8, 8) == 8
    assert ceiling.next(8, 8, 3) == 8  # a rejection after 3: 2 (3 + 1), within the cap
    assert ceiling.next(8, 8, 1) == 4
    assert ceiling.next(8, 8, 0) == 2  # rejected at once: k
    assert ceiling.next(4, 1, 1) == 4  # fewer drafts than the ceiling: kept
    output = list(range(1, 40))
    prompt = [*output, 0]  # a copy of the prompt: every draft of the oracle accepted
    fixed = replay(oracle_draft(output, len(prompt)), "r", prompt, output, Ceiling(2, 2))
    raised = replay(oracle_draft(output, len(prompt)), "r", prompt, output, Ceiling(2, 8))
    assert fixed.steps == 13  # 38 tokens after the first, 3 a step
    assert raised.steps == 6  # 3, 5, 9, 9, 9 and the last 3


@pytest.mark.parametrize("k, cap", [(0, 4), (4, 3)])
def test_the_ceiling_refuses_bad_bounds_by_name(k: int, cap: int):
    with pytest.raises(ValueError, match="k" if k < 1 else "cap"):
        Ceiling(k, cap)


def test_count_steps_replays_each_request_on_one_proposer_and_drops_its_state():
    source = [10, 11, 12, 13, 14, 15, 16, 17]
    prompts = [[*source, 5], [*source, 6]]
    outputs = [[10, 11, 12, 13, 99, 15, 16, 17], [10, 11, 12, 13, 14, 15, 16, 17]]
    made: list[NgramProposer] = []

    def make() -> NgramProposer:
        made.append(NgramProposer())
        return made[-1]
    ngram = [c.steps for c in count_steps(make, prompts, outputs, Ceiling(4, 4))]
    oracle = [c.steps for c in count_steps("oracle", prompts, outputs, Ceiling(4, 4))]
    assert len(made) == 1 and not made[0]._sources
    # 99 replaced 14: 11-14 drafted, 3 accepted; then 99 is new, a substitution: 15-17 accepted
    assert ngram == [2, 2] and oracle == [2, 2]
    assert count_steps(make, prompts, outputs, Ceiling(1, 1)) == [Replayed(4, 4)] * 2  # 2 a step


def test_the_occurrence_oracle_copies_only_after_an_earlier_last_token():
    prompt, output = [1, 2, 3, 9, 7, 8, 5], [9, 7, 8, 4]
    anywhere = oracle_draft(output, len(prompt))
    after_last = oracle_draft(output, len(prompt), after_last=True)
    # after "9" the output wants "7 8 4": both find "7 8" after the earlier 9
    assert anywhere("r", [*prompt, 9], 3) == after_last("r", [*prompt, 9], 3) == [7, 8]
    # after "5" (seen nowhere before): "7 8" still lies in the tokens, but not after a 5
    assert anywhere("r", [*prompt, 9, 7, 8], 3) == after_last("r", [*prompt, 9, 7, 8], 3) == []
    assert oracle_draft([5, 7, 8], 3)("r", [1, 7, 8, 5], 2) == [7, 8]
    assert oracle_draft([5, 7, 8], 3, after_last=True)("r", [1, 7, 8, 5], 2) == []
    with pytest.raises(ValueError, match="make"):
        count_steps("wizard", [[1]], [[1]], Ceiling(4, 4))


def test_copied_share_counts_the_prompt_copied_in_order_in_blocks_of_four_or_more():
    prompt = list(range(100, 120))
    assert copied_share(prompt, prompt[2:14]) == 1.0
    # an edit inside the copy: 11 of 12 tokens copied, in blocks of 5 and 6
    edited = [*prompt[2:7], 999, *prompt[8:14]]
    assert copied_share(prompt, edited) == pytest.approx(11 / 12)
    # a line of the prompt repeated: only its first copy is in order
    assert copied_share(prompt, prompt[:5] * 4) == pytest.approx(5 / 20)
    # blocks shorter than min_block do not count (single common tokens of new prose)
    assert copied_share(prompt, [100, 101, 7, 105, 106, 8]) == 0.0
    assert copied_share(prompt, []) == 0.0


def test_the_prompt_sets_keep_v1_and_refuse_an_unknown_name():
    assert DEFAULT_PROMPT_SET == "copy-edit"
    assert [p.chat()[0]["content"] for p in prompt_set("v1")] == list(V1_TEXTS)
    for prompt in prompt_set("copy-edit"):  # system, the example exchange, the request
        assert [m["role"] for m in prompt.chat()] == ["system", "user", "assistant", "user"]
    assert len({p.name for p in prompt_set("copy-edit")}) == len(prompt_set("copy-edit"))
    with pytest.raises(ValueError, match="prompt_set"):
        prompt_set("v2")
    with pytest.raises(ValueError, match="user message"):
        Prompt("bad", (("user", "x"), ("assistant", "y")))
