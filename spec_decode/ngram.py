"""Prompt lookup (vLLM's ``ngram`` method): drafts copied from earlier in the request's tokens.

A lookup: for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the request's last n
tokens are searched for earlier in its tokens; the first n that recurs wins (the longest), and
the tokens that followed the chosen occurrence are the drafts. Among the occurrences of that
n-gram the chosen one is, in order of preference:

1. the one whose match extends furthest back past the n-gram (up to ``max_match`` tokens): a
   model copying a passage matches that passage over the whole stretch copied so far, where a
   common n-gram ("    return", ``", "``) also recurs elsewhere;
2. the nearest at or after the request's *anchor* (within ``ANCHOR_WINDOW`` tokens): where its
   last copy broke off in the source. A model that edits what it copies (a renamed variable, a
   changed value) resumes copying just past the edit, so an n-gram after the edit is looked
   for there first;
3. the one whose next token follows the most occurrences of the n-gram (a vote: the
   continuation the request repeats);
4. the latest.

When the request's last token occurs nowhere before it (a word the output put in place of
one of its source's), the lookup is of the tokens before it, and the drafts skip the one token
after the chosen occurrence: the replaced one (``match`` returns that with a match of 0).
Only where those tokens match ``SUBSTITUTION_RUN`` tokens back (a copy in progress): a new
word in new prose would otherwise draft tokens that are rarely accepted and make the
verification dearer than a decode.

Continuation: the proposer remembers, per request, where in its tokens its last drafts were
copied from. When the tokens appended since (accepted drafts and the model's own token) are
exactly the source's next tokens, the next drafts continue from the source without a lookup.
Otherwise, if the output had copied at least ``RESUME_RUN`` tokens in a row from it, the anchor
moves to where the two parted. For ``MAX_INSERT`` tokens after that, a lookup that found
nothing near the anchor and nothing matching ``RESUME_RUN`` tokens back gives way to the
anchor itself: the output inserted something (a line break while reformatting JSON) and the
copy resumes where it broke off. That guess is made once per break: rejected outright, it
is not repeated (the output rewrote rather than inserted). State is per running request (a
few integers), dropped by ``on_finished``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from twinserve.spec_decode.proposer import ProposalRequest

MAX_MATCH = 256  # default of how far back a match is extended to rank occurrences
ANCHOR_WINDOW = 16  # occurrences ending this far past the anchor count as "near" it
RESUME_RUN = 4  # a copy of this many tokens in a row sets the anchor where it breaks off
MAX_INSERT = 4  # tokens after a break during which the copy may resume at the anchor
SUBSTITUTION_RUN = 2  # how far the tokens before a new one must match for a substitution


@dataclass(slots=True)
class _Source:
    """Where a request's last drafts came from: ``start`` indexes the first draft's source
    token, proposed when the request had ``num_tokens`` tokens; ``anchor`` is where the last
    copy broke off (None before any)."""

    num_tokens: int
    start: int | None
    anchor: int | None = None
    run: int = 0  # tokens the output has copied from ``start``'s source in a row
    parted_at: int | None = None  # the request's token count where it left the anchor's source
    guessed: bool = False  # ``start`` is the anchor, guessed after an insertion


@dataclass(slots=True)
class NgramProposer:
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    max_match: int = MAX_MATCH  # bounds a lookup's cost
    _sources: dict[str, _Source] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}.")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({self.prompt_lookup_min}).")
        if self.max_match < self.prompt_lookup_max:
            raise ValueError(f"max_match ({self.max_match}) must be >= prompt_lookup_max "
                             f"({self.prompt_lookup_max}).")

    def propose(self, requests: Sequence[tuple[ProposalRequest, int]]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for request, num_drafts in requests:
            if num_drafts <= 0:
                continue
            tokens = request.all_token_ids
            tokens = tokens if isinstance(tokens, list) else list(tokens)
            found = self.draft(request.request_id, tokens, num_drafts)
            if found:
                drafts[request.request_id] = found
        return drafts

    def on_finished(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._sources.pop(request_id, None)

    def draft(self, request_id: str, tokens: list[int], num_drafts: int) -> list[int]:
        """The drafts for request ``request_id`` whose tokens are now ``tokens``: the source's
        continuation when the tokens followed it, else a lookup (module docstring)."""
        total = len(tokens)
        state = self._sources.get(request_id)
        anchor = parted_at = None
        if state is not None and state.num_tokens <= total:
            anchor, parted_at = state.anchor, state.parted_at
            if state.start is not None:
                start, appended = state.start, total - state.num_tokens
                followed = _common_prefix(tokens, state.num_tokens, start, appended)
                if followed == appended and start + appended < total:
                    start += appended
                    self._sources[request_id] = _Source(total, start, anchor, state.run + appended,
                                                        parted_at)
                    return tokens[start:min(start + num_drafts, total)]
                if state.run + followed >= RESUME_RUN:  # a copy broke off here
                    anchor, parted_at = start + followed, state.num_tokens + followed
                elif state.guessed and not followed:  # one insertion guess per break
                    parted_at = None
        found = self.match(tokens, anchor)
        source: int | None = None if found is None else found[0]
        guess = anchor is not None and parted_at is not None and 0 < total - parted_at <= MAX_INSERT \
            and (found is None or not found[2] and found[1] < RESUME_RUN)
        if guess:
            source = anchor  # an insertion: the copy resumes where it broke off
        self._sources[request_id] = _Source(total, source, anchor, 0, parted_at, guess)
        return [] if source is None else tokens[source:source + num_drafts]

    def lookup(self, tokens: list[int], num_drafts: int, anchor: int | None = None) -> list[int]:
        """Stateless: up to ``num_drafts`` tokens after the chosen occurrence of the longest
        recurring suffix of ``tokens`` (empty: no match)."""
        found = self.match(tokens, anchor)
        return [] if found is None else tokens[found[0]:found[0] + num_drafts]

    def match(self, tokens: list[int], anchor: int | None = None) -> tuple[int, int, bool] | None:
        """The chosen occurrence of the longest suffix of ``tokens`` (``prompt_lookup_min`` to
        ``prompt_lookup_max`` long) that occurs earlier: the index of the token after it, how
        far back it matches and whether it lies near ``anchor``. When the last token occurs
        nowhere before, the suffix before it is looked up instead and the index is one further
        (a substitution: the new token replaced the source's next one), matching 0 tokens back,
        if that suffix matches ``SUBSTITUTION_RUN`` tokens back; None otherwise."""
        total = len(tokens)
        if total < 2:
            return None
        ends = _occurrences(tokens, tokens[-1], total - 1)  # of the last token, latest first
        if ends:
            return self._longest(tokens, total, ends, anchor)
        if total < 3:
            return None
        before = self._longest(tokens, total - 1, _occurrences(tokens, tokens[-2], total - 2), anchor)
        if before is None or before[1] < SUBSTITUTION_RUN or before[0] + 1 >= total - 1:
            return None
        return before[0] + 1, 0, False

    def _longest(self, tokens: list[int], total: int, ends: list[int],
                 anchor: int | None) -> tuple[int, int, bool] | None:
        """``match`` on ``tokens[:total]``, whose last token occurs at ``ends``, without the
        substitution fallback."""
        for n in range(min(self.prompt_lookup_max, total - 1), self.prompt_lookup_min - 1, -1):
            pattern = tokens[total - n:total]
            hits = [end for end in ends if end >= n - 1 and tokens[end - n + 1:end + 1] == pattern]
            if hits:
                longest = self.max_match if n == self.prompt_lookup_max else n
                end, length, near = _best(tokens, total, hits, n, longest, anchor)
                return end + 1, length, near
        return None


def _occurrences(tokens: list[int], token: int, stop: int) -> list[int]:
    """Indices below ``stop`` where ``token`` occurs, latest first (``list.index`` scans in C)."""
    found = []
    i = -1
    try:
        while True:
            i = tokens.index(token, i + 1, stop)
            found.append(i)
    except ValueError:
        pass
    found.reverse()
    return found


def _best(tokens: list[int], total: int, hits: list[int], n: int, longest: int,
          anchor: int | None) -> tuple[int, int, bool]:
    """The preferred of ``hits`` (ends of occurrences of the last ``n`` of ``tokens[:total]``,
    latest first): longest match back (up to ``longest`` tokens), then nearest at or after
    ``anchor``, then the one whose next token follows the most hits (a vote), then latest.
    Returns its end, its match length and whether it is near ``anchor``."""
    def rank(end: int) -> tuple[int, int]:
        near = anchor is not None and 0 <= end - anchor <= ANCHOR_WINDOW
        closeness = -(end - anchor) if near else -ANCHOR_WINDOW - 1  # type: ignore[operator]
        return _match_back(tokens, total - 1, end, n, longest), closeness
    ranks = [rank(end) for end in hits]
    top = max(ranks)
    tied = [end for end, r in zip(hits, ranks, strict=True) if r == top]
    end = tied[0]
    if len(tied) > 1:  # the vote, counted only when needed: every hit ends before the last token
        votes = Counter(tokens[hit + 1] for hit in hits)
        end = max(tied, key=lambda hit: (votes[tokens[hit + 1]], hit))
    return end, top[0], top[1] >= -ANCHOR_WINDOW


def _match_back(tokens: list[int], last: int, end: int, n: int, longest: int) -> int:
    """How many tokens ending at ``end`` equal those ending at ``last`` (at least ``n``, known
    to match; at most ``longest``)."""
    length = n
    while length < longest and end - length >= 0 and tokens[end - length] == tokens[last - length]:
        length += 1
    return length


def _common_prefix(tokens: list[int], at: int, source: int, limit: int) -> int:
    """How many of the ``limit`` tokens from ``at`` equal those from ``source``."""
    count = 0
    while count < limit and tokens[at + count] == tokens[source + count]:
        count += 1
    return count
