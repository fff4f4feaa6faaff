"""Prompt lookup (vLLM's ``ngram`` method): drafts copied from earlier in the request's tokens.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the request's last n tokens are
searched for earlier in its tokens; the first n that matches wins (the longest), and the tokens
that followed its latest occurrence are the drafts. Stateless: nothing is kept per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from twinserve.spec_decode.proposer import ProposalRequest


@dataclass(slots=True, frozen=True)
class NgramProposer:
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}.")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({self.prompt_lookup_min}).")

    def propose(self, requests: Sequence[tuple[ProposalRequest, int]]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for request, num_drafts in requests:
            if num_drafts <= 0:
                continue
            found = self.lookup(list(request.all_token_ids), num_drafts)
            if found:
                drafts[request.request_id] = found
        return drafts

    def on_finished(self, request_ids: Sequence[str]) -> None:
        del request_ids  # stateless

    def lookup(self, tokens: list[int], num_drafts: int) -> list[int]:
        """The drafts for ``tokens``: up to ``num_drafts`` tokens after the latest earlier
        occurrence of the longest matching suffix (empty: no match)."""
        total = len(tokens)
        for n in range(min(self.prompt_lookup_max, total - 1), self.prompt_lookup_min - 1, -1):
            pattern = tokens[total - n:]
            last = pattern[-1]
            # the latest occurrence that ends before the last token (so a token follows it)
            for end in range(total - 2, n - 2, -1):
                if tokens[end] == last and tokens[end - n + 1:end + 1] == pattern:
                    return tokens[end + 1:end + 1 + num_drafts]
        return []
