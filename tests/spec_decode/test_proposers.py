"""The model-free proposers: prompt lookup (ngram) and suffix decoding."""

from __future__ import annotations

import pytest

from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.spec_decode.ngram import NgramProposer
from twinserve.spec_decode.suffix import SuffixProposer, SuffixTrie


def _request(rid: str, prompt: list[int], output: list[int] = ()) -> Request:
    request = Request(rid, prompt, SamplingParams(max_tokens=64), 0.0)
    for token in output:
        request.append_output_token(token, 0.0)
    return request


def test_ngram_takes_the_longest_match_and_its_latest_occurrence():
    ngram = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    # "2 3" occurs twice; the longest suffix that recurs is "1 2 3" (followed by 4 5)
    assert ngram.lookup([1, 2, 3, 4, 5, 2, 3, 9, 1, 2, 3], 2) == [4, 5]
    # only "3" recurs: its latest earlier occurrence is followed by 9
    assert ngram.lookup([1, 3, 7, 3, 9, 8, 3], 3) == [9, 8, 3]
    assert ngram.lookup([1, 2, 3, 4], 3) == []
    assert NgramProposer(2, 3).lookup([1, 3, 7, 3, 9, 8, 3], 3) == []  # n = 1 below the minimum


def test_ngram_prefers_the_occurrence_that_matches_furthest_back():
    tokens = [7, 1, 2, 3, 40, 9, 1, 2, 50, 7, 1, 2]
    # "1 2" occurs twice; the first is preceded by 7, as the end is: the longer match wins
    assert NgramProposer(1, 2).lookup(tokens, 2) == [3, 40]
    assert NgramProposer(1, 2, max_match=2).lookup(tokens, 2) == [50, 7]  # unextended: latest


def _steps(ngram: NgramProposer, prompt: list[int], output: list[int], k: int) -> list[list[int]]:
    """Greedy verification of ``output`` against the proposer's drafts: the drafts of each step."""
    tokens, pos, seen = [*prompt, output[0]], 1, []
    while pos < len(output):
        drafts = ngram.draft("r", list(tokens), k)
        seen.append(drafts)
        accepted = 0
        while accepted < len(drafts) and pos + accepted < len(output) \
                and drafts[accepted] == output[pos + accepted]:
            accepted += 1
        tokens += output[pos:pos + accepted + 1]
        pos += accepted + 1
    return seen


def test_ngram_continues_the_source_its_accepted_drafts_came_from():
    ngram = NgramProposer(1, 2, max_match=2)  # a lookup alone would take the latest "3 4"
    prompt = [9, 1, 2, 3, 4, 5, 6, 7, 0, 3, 4, 8, 8]
    assert _steps(ngram, prompt, [1, 2, 3, 4, 5, 6, 7], 2) == [[2, 3], [5, 6]]
    assert ngram.lookup([*prompt, 1, 2, 3, 4], 2) == [8, 8]
    ngram.on_finished(["r"])
    assert not ngram._sources


def test_ngram_resumes_a_copy_after_an_edit_where_it_broke_off():
    source = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    # a replacement (16 -> 99): the insertion guess (16...) fails, then the copy's 17 is taken
    # over the later, equally long match of "17" in the instruction (5, 17, 30, 31)
    steps = _steps(NgramProposer(1, 4), [*source, 5, 17, 30, 31],
                   [10, 11, 12, 13, 14, 15, 99, 17, 18, 19], 4)
    assert steps == [[11, 12, 13, 14], [16, 17, 18, 19], [16, 17, 18, 19], [18, 19, 5, 17]]
    # a rewrite (90 91 92 93 for 16...): the insertion guess is made once, then no drafts
    steps = _steps(NgramProposer(1, 4), [*source, 5], [10, 11, 12, 13, 14, 15, 90, 91, 92, 93], 4)
    assert steps == [[11, 12, 13, 14], [16, 17, 18, 19], [16, 17, 18, 19], [], []]
    # an insertion (77 before 16): the copy resumes at the source
    steps = _steps(NgramProposer(1, 4), [*source, 5, 14], [10, 11, 12, 13, 14, 15, 77, 16, 17, 18, 19], 4)
    assert steps == [[11, 12, 13, 14], [16, 17, 18, 19], [16, 17, 18, 19]]


def test_ngram_breaks_ties_by_a_vote_among_occurrences():
    # "5" occurs three times, each matching 1 back; two are followed by 6, the latest by 8
    tokens = [1, 5, 6, 2, 5, 6, 3, 5, 8, 4, 5]
    assert NgramProposer(1, 1).lookup(tokens, 2) == [6, 3]  # the later of the two 6s
    # a tied vote goes to the latest
    assert NgramProposer(1, 1).lookup([1, 5, 6, 2, 5, 8, 4, 5], 2) == [8, 4]
    # a longer match back ("4 5") still outranks the vote
    assert NgramProposer(1, 1).lookup([1, 5, 6, 2, 5, 6, 4, 5, 8, 4, 5], 2) == [8, 4]


def test_ngram_takes_a_new_token_for_a_substitution_of_the_next_source_token():
    ngram = NgramProposer(1, 4)
    source = [10, 11, 12, 13, 14, 15]
    # 99 occurs nowhere before: it replaced 13 after "11 12", so the drafts resume at 14
    assert ngram.match([*source, 7, 11, 12, 99]) == (4, 0, False)
    assert ngram.lookup([*source, 7, 11, 12, 99], 3) == [14, 15, 7]
    assert ngram.lookup([10, 11, 12, 7, 10, 11, 99], 3) == [7, 10, 11]
    # the tokens before it match only 1 back ("10"): no copy in progress, no drafts
    assert ngram.lookup([10, 11, 12, 10, 99], 3) == []
    # the token it would skip to is the new one itself: nothing to draft
    assert ngram.lookup([7, 7, 7, 99], 3) == []
    # a token seen before is looked up as itself (no substitution), below the minimum too
    assert NgramProposer(2, 4).lookup([*source, 7, 12], 3) == []
    steps = _steps(NgramProposer(1, 4), [*source, 7], [10, 11, 12, 99, 14, 15], 4)
    assert steps == [[11, 12, 13, 14], [14, 15, 7, 10]]  # the copy resumes past the substitution


def test_ngram_proposes_at_most_the_number_wanted_and_none_for_zero():
    ngram = NgramProposer(1, 4)
    request = _request("a", [5, 6, 7, 8, 5, 6], [7])
    assert ngram.propose([(request, 1)]) == {"a": [8]}
    assert ngram.propose([(request, 0)]) == {}


@pytest.mark.parametrize("bad", [dict(prompt_lookup_min=0), dict(prompt_lookup_min=3,
                                                                 prompt_lookup_max=2),
                                 dict(prompt_lookup_max=4, max_match=3)])
def test_ngram_refuses_bad_bounds_by_name(bad):
    with pytest.raises(ValueError, match="prompt_lookup_m|max_match"):
        NgramProposer(**bad)


def test_suffix_trie_counts_paths_and_remove_restores_it():
    trie = SuffixTrie(max_depth=3)
    trie.extend([1, 2, 3, 1, 2, 4])
    trie.end_sequence()
    assert trie.root.children[1].count == 2
    assert trie.root.children[1].children[2].count == 2
    assert set(trie.root.children[1].children[2].children) == {3, 4}
    assert 1 not in trie.root.children[1].children[2].children[3].children  # depth 3 at most
    trie.extend([7, 8])
    trie.remove([1, 2, 3, 1, 2, 4])
    assert set(trie.root.children) == {7, 8} and trie.root.children[7].children[8].count == 1


def test_suffix_follows_the_most_frequent_continuation_within_the_spec_factor():
    trie = SuffixTrie(max_depth=8)
    for seq in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 9, 9, 9]):
        trie.extend(seq)
        trie.end_sequence()
    assert trie.propose([7, 1, 2], 4, max_spec_factor=2.0, min_token_prob=0.1) == [3, 4, 5]
    # match length 2 x factor 1 = at most 2 drafts
    assert trie.propose([7, 1, 2], 4, max_spec_factor=1.0, min_token_prob=0.1) == [3, 4]
    # 3 follows "1 2" with probability 2/3 only
    assert trie.propose([7, 1, 2], 4, max_spec_factor=2.0, min_token_prob=0.7) == []


def test_suffix_drafts_from_a_shorter_suffix_when_the_longest_ends_at_the_depth_bound():
    trie = SuffixTrie(max_depth=4)
    trie.extend([1, 2, 3, 4, 5, 6, 7, 8])
    trie.end_sequence()
    # "1 2 3" ends at depth 3: one token to its bound; "2 3" leaves two (the spec factor's 2)
    assert trie.propose([1, 2, 3], 4, max_spec_factor=1.0, min_token_prob=0.1) == [4, 5]
    assert trie.propose([1, 2, 3], 4, max_spec_factor=3.0, min_token_prob=0.1) == [4, 5, 6]


def test_suffix_uses_the_request_and_finished_requests_outputs():
    suffix = SuffixProposer(max_tree_depth=8, max_cached_requests=1)
    own = _request("a", [4, 5, 6, 7, 4, 5])
    assert suffix.propose([(own, 2)]) == {"a": [6, 7]}  # from its own prompt
    done = _request("b", [1], [20, 21, 22, 23, 24])
    suffix.propose([(done, 1)])
    suffix.on_finished(["b"])
    later = _request("c", [9, 9, 20, 21])
    assert suffix.propose([(later, 3)]) == {"c": [22, 23]}  # match 2, factor 1
    other = _request("d", [30], [31, 32, 33])
    suffix.propose([(other, 1)])
    suffix.on_finished(["d"])  # evicts b's output (one cached request at most)
    assert suffix.propose([(_request("e", [8, 20, 21]), 3)]) == {}


def test_suffix_refuses_bad_settings_by_name():
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
        SuffixProposer(min_token_prob=1.5)
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth"):
        SuffixProposer(max_tree_depth=0)
