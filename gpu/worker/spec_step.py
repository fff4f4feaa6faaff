"""The model runner's share of speculative decoding: verify a step's drafts, then propose the
next step's.

Verification entries (``ScheduledRequest.spec_token_ids``) have logits at all 1 + k positions.
Position j is sampled as the request would be after the drafts before it: its penalties,
min_tokens and bad words see ``output + drafts[:j]`` (``DraftPosition``). A request under a
grammar is not verified: its first position is sampled under the grammar's mask and its drafts
count as rejected (the scheduler is expected not to give it drafts; this keeps it correct if it
does). Logprobs are those of the raw logits at each emitted token's position (vLLM v1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from twinserve.core.outputs import ModelRunnerOutput, ScheduledRequest
from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.worker.logprobs import token_logprobs
from twinserve.gpu.worker.rejection_sampler import VerifySettings, strict_accept, verify
from twinserve.gpu.worker.sampler import DraftPosition, process_logits, sample, target_probs
from twinserve.gpu.worker.structured_outputs import StructuredOutputs
from twinserve.spec_decode.proposer import Proposer


@runtime_checkable
class ProbabilisticProposer(Proposer, Protocol):
    """A proposer that drew its drafts from a distribution (a draft model): ``draft_probs``
    returns it for the drafts of ``request_id`` (``[len(drafts), V]``), None when unknown."""

    def draft_probs(self, request_id: str, drafts: Sequence[int]) -> torch.Tensor | None: ...


@dataclass(slots=True, frozen=True)
class PendingRequest:
    """A request as a proposer sees it after sampling: its tokens end with this step's."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    request: Request

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass(slots=True)
class SpecStep:
    proposer: Proposer
    settings: VerifySettings
    _probabilistic: bool = field(init=False)

    def __post_init__(self) -> None:
        self._probabilistic = isinstance(self.proposer, ProbabilisticProposer)

    def sample(self, entries: list[ScheduledRequest], counts: list[int], logits: torch.Tensor,
               structured: StructuredOutputs | None, generators: list[torch.Generator | None],
               default_generator: torch.Generator, out: ModelRunnerOutput) -> None:
        """Fills ``out`` for the sampling ``entries``, whose logits rows are ``counts`` long."""
        offsets = [0]
        for count in counts[:-1]:
            offsets.append(offsets[-1] + count)
        plain = [j for j, sr in enumerate(entries) if not sr.spec_token_ids
                 or sr.request.sampling_params.structured_outputs is not None]
        if plain:
            self._sample_plain([entries[j] for j in plain], logits[[offsets[j] for j in plain]],
                               structured, [generators[j] for j in plain], default_generator, out)
        verifying = [j for j, sr in enumerate(entries) if sr.spec_token_ids
                     and sr.request.sampling_params.structured_outputs is None]
        if not verifying:
            return
        if plain:
            rows = [r for j in verifying for r in range(offsets[j], offsets[j] + counts[j])]
            raw = logits[rows]
        else:
            raw = logits
        # every verified position's logits processed at once, and one argmax for all of them:
        # per request, these calls cost more than the whole batch's (the step's Python overhead)
        positions = [p for j in verifying for p in _draft_positions(entries[j])]
        processed = process_logits(raw, positions)
        best = processed.argmax(dim=-1).tolist()
        row = 0
        for j in verifying:
            n = counts[j]
            self._verify(entries[j], raw[row:row + n], processed[row:row + n], best[row:row + n],
                         generators[j] or default_generator, out)
            row += n

    def propose(self, scheduled: list[ScheduledRequest], sample_index: list[int],
                out: ModelRunnerOutput) -> None:
        """Asks the proposer for the drafts the scheduler wants next (``num_draft_next``)."""
        wanted: list[tuple[PendingRequest, int]] = []
        for i in sample_index:
            sr = scheduled[i]
            request = sr.request
            tokens = out.sampled_token_ids.get(request.request_id)
            if sr.num_draft_next <= 0 or not tokens or request.pooling_params is not None \
                    or request.sampling_params.structured_outputs is not None:
                continue
            wanted.append((PendingRequest(request.request_id, [*request.all_token_ids, *tokens],
                                          request.num_prompt_tokens, request.sampling_params,
                                          request), sr.num_draft_next))
        if not wanted:
            return
        drafts = self.proposer.propose(wanted)
        for pending, num in wanted:
            found = drafts.get(pending.request_id)
            if found:
                out.spec_token_ids[pending.request_id] = list(found[:num])

    def _sample_plain(self, entries: list[ScheduledRequest], logits: torch.Tensor,
                      structured: StructuredOutputs | None,
                      generators: list[torch.Generator | None],
                      default_generator: torch.Generator, out: ModelRunnerOutput) -> None:
        requests = [sr.request for sr in entries]
        allowed = structured.bitmask(requests) if structured is not None else None
        result = sample(logits, requests, generators, default_generator, allowed)
        if allowed is not None and structured is not None:
            structured.advance(requests, result.token_ids)
        for request, token, logprobs in zip(requests, result.token_ids, result.logprobs):
            out.sampled_token_ids[request.request_id] = [token]
            if logprobs is not None:
                out.logprobs[request.request_id] = [logprobs]

    def _verify(self, sr: ScheduledRequest, raw: torch.Tensor, logits: torch.Tensor,
                best: list[int], generator: torch.Generator, out: ModelRunnerOutput) -> None:
        """One entry: ``raw`` and ``logits`` (processed) at its 1 + k positions, ``best`` their
        argmax."""
        request = sr.request
        params = request.sampling_params
        drafts = sr.spec_token_ids
        if params.greedy and self.settings.method != "synthetic":
            tokens = strict_accept(drafts, best)
        else:
            probs = None if params.greedy else target_probs(logits, [params] * len(best))
            draft_probs = None
            if self._probabilistic and not params.greedy:
                draft_probs = self.proposer.draft_probs(request.request_id, drafts)  # type: ignore[attr-defined]
            tokens = verify(self.settings, params.greedy, drafts, logits, probs, draft_probs,
                            generator)
        out.sampled_token_ids[request.request_id] = tokens
        if params.logprobs is not None:
            out.logprobs[request.request_id] = token_logprobs(
                raw[:len(tokens)], tokens, [params.logprobs] * len(tokens))


def _draft_positions(sr: ScheduledRequest) -> list[DraftPosition]:
    """The request seen from each of its 1 + k positions: penalties, min_tokens and bad words
    see its output followed by the drafts before the position."""
    request = sr.request
    params, prompt, eos = request.sampling_params, request.prompt_token_ids, request.eos_token_id
    output = list(request.output_token_ids)
    drafts = sr.spec_token_ids
    return [DraftPosition(params, prompt, [*output, *drafts[:j]] if j else output, eos)
            for j in range(len(drafts) + 1)]
