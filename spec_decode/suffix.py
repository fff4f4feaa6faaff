"""Suffix decoding (SuffixDecoding, NeurIPS 2025; vLLM's ``suffix`` method), written here.

Two frequency tries of token paths, each path at most ``max_tree_depth`` tokens: one per running
request over its prompt and output (every suffix of the tokens is a path from the root), and a
global one over the outputs of the last ``max_cached_requests`` finished requests (the oldest is
subtracted again when one more arrives). A proposal takes each suffix of the request's tokens
that is a path of a trie and follows, from its end, the most frequent child while the path's
estimated probability (the product of child count / sum of the children's counts) stays at
least ``min_token_prob``, for at most ``max_spec_factor * match length`` tokens; the longest
draft wins, from the longer suffix on a tie (the longest suffix alone ends nearest the depth
bound: inside a copy it drafts one token). Both tries are asked; the longer draft wins (the
request's own on a tie).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from twinserve.spec_decode.proposer import ProposalRequest


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


@dataclass(slots=True)
class SuffixTrie:
    """Counts of every token path of length <= ``max_depth`` in the sequences added to it."""

    max_depth: int
    root: _Node = field(default_factory=_Node)
    # ends of the paths still growing with the next token appended (``extend``)
    _open: list[_Node] = field(default_factory=list)

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends ``tokens`` to the sequence being added (every suffix grows by one)."""
        for token in tokens:
            grown = []
            for node in [*self._open, self.root]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                grown.append(child)
            self._open = grown[-self.max_depth + 1:] if self.max_depth > 1 else []

    def end_sequence(self) -> None:
        self._open = []

    def remove(self, tokens: Sequence[int]) -> None:
        """Subtracts a sequence added before (its paths' counts; empty nodes dropped)."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    break
                node = child

    def propose(self, context: Sequence[int], num_drafts: int, max_spec_factor: float,
                min_token_prob: float) -> list[int]:
        """The longest draft after any suffix of ``context`` that is a path here (the longer
        suffix on a tie). Every length is tried, as SuffixDecoding scores each: the longest
        suffix ends deepest, where the depth bound leaves the fewest tokens to draft."""
        best: list[int] = []
        for match in range(min(len(context), self.max_depth - 1), 0, -1):
            limit = min(num_drafts, math.floor(max_spec_factor * match))
            if limit <= len(best):
                break  # shorter suffixes are allowed no more tokens than this
            node = self._walk(context[len(context) - match:])
            if node is None or not node.children:
                continue
            draft = _follow(node, limit, min_token_prob)
            if len(draft) > len(best):
                best = draft
        return best

    def _walk(self, path: Sequence[int]) -> _Node | None:
        node = self.root
        for token in path:
            child = node.children.get(token)
            if child is None:
                return None
            node = child
        return node


def _follow(node: _Node, limit: int, min_token_prob: float) -> list[int]:
    draft: list[int] = []
    prob = 1.0
    while len(draft) < limit and node.children:
        total = sum(child.count for child in node.children.values())
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        prob *= child.count / total
        if prob < min_token_prob:
            break
        draft.append(token)
        node = child
    return draft


@dataclass(slots=True)
class _RequestState:
    trie: SuffixTrie
    num_prompt: int
    num_seen: int = 0  # tokens of the request already in its trie
    output: list[int] = field(default_factory=list)  # for the global trie once it finishes


@dataclass(slots=True)
class SuffixProposer:
    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    _requests: dict[str, _RequestState] = field(default_factory=dict)
    _global: SuffixTrie = field(init=False)
    _cached: OrderedDict[str, list[int]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        for name in ("max_tree_depth", "max_cached_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"suffix_decoding_{name} must be a non-negative integer, "
                                 f"got {value!r}.")
        if self.max_tree_depth < 1:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 1.")
        if not self.max_spec_factor > 0:
            raise ValueError(f"suffix_decoding_max_spec_factor must be > 0, "
                             f"got {self.max_spec_factor!r}.")
        if not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob must be in [0, 1], "
                             f"got {self.min_token_prob!r}.")
        self._global = SuffixTrie(self.max_tree_depth)

    def propose(self, requests: Sequence[tuple[ProposalRequest, int]]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for request, num_drafts in requests:
            state = self._state_of(request)
            if num_drafts <= 0:
                continue
            context = request.all_token_ids[max(0, request.num_tokens - self.max_tree_depth):]
            args = (num_drafts, self.max_spec_factor, self.min_token_prob)
            own = state.trie.propose(context, *args)
            shared = self._global.propose(context, *args) if self._cached else []
            best = shared if len(shared) > len(own) else own
            if best:
                drafts[request.request_id] = best
        return drafts

    def on_finished(self, request_ids: Sequence[str]) -> None:
        """Drops the requests' tries; their outputs enter the global trie."""
        for request_id in request_ids:
            state = self._requests.pop(request_id, None)
            if state is None or self.max_cached_requests == 0:
                continue
            output = state.output
            if not output:
                continue
            self._global.extend(output)
            self._global.end_sequence()
            self._cached[request_id] = output
            while len(self._cached) > self.max_cached_requests:
                _, old = self._cached.popitem(last=False)
                self._global.remove(old)

    def _state_of(self, request: ProposalRequest) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(
                SuffixTrie(self.max_tree_depth), num_prompt=request.num_prompt_tokens)
        new = request.all_token_ids[state.num_seen:]
        if new:
            state.trie.extend(new)
            state.output.extend(new[max(0, state.num_prompt - state.num_seen):])
            state.num_seen += len(new)
        return state
