"""The proposer seam: the backend asks for drafts after sampling a step.

``propose`` receives ``(request, num_drafts wanted)`` pairs and returns the drafts per request
id: at most the number wanted, maybe fewer, or none (absent). The backend proposes before the
scheduler appends the step's tokens, so it passes a view whose ``all_token_ids`` already ends
with them (``ProposalRequest``: what a proposer may read; a ``Request`` is one).
``on_finished`` drops the state of requests that left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from twinserve.core.sampling_params import SamplingParams


class ProposalRequest(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def sampling_params(self) -> SamplingParams: ...


class Proposer(Protocol):
    def propose(self, requests: Sequence[tuple[ProposalRequest, int]]) -> dict[str, list[int]]: ...

    def on_finished(self, request_ids: Sequence[str]) -> None: ...
