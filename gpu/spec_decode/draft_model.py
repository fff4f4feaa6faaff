"""The draft model proposer (vLLM's ``draft_model`` method): a smaller model with the target's
vocabulary drafts k tokens autoregressively.

The draft runs in its own ``ModelRunner`` (its own weights and KV cache) with its own block
list per request: a free list of the draft cache's blocks, a request's blocks freed when it
finishes (or when the draft cache runs out: that request then gets no drafts until it is
caught up again). The draft remembers which tokens its cache holds; each ``propose`` keeps the
prefix they share with the request's tokens (rejected drafts fall away) and computes the rest
in one chunk, whose last position gives the first draft, then k - 1 single-token steps. All
requests of a call run batched.

Greedy requests draw the argmax; sampled requests draw from the draft's distribution under the
request's temperature, top-k/p and min-p, and ``draft_probs`` returns that distribution, so the
probabilistic verification (accept with min(1, p/q)) keeps the target's distribution exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from twinserve.core.engine_args import EngineArgs
from twinserve.core.outputs import ScheduledRequest
from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.worker.model_runner import ModelRunner
from twinserve.gpu.worker.sampler import target_probs
from twinserve.spec_decode.proposer import ProposalRequest


@dataclass(slots=True)
class _DraftState:
    request: Request            # its all_token_ids: the tokens the draft's cache holds, + drafts
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0       # tokens of ``request.all_token_ids`` whose KV is in the cache


class DraftModelProposer:
    """Drafts from ``model`` run with the target's engine arguments (its own KV cache of
    ``kv_cache_memory_bytes`` where given)."""

    def __init__(self, args: EngineArgs, model: str, target_vocab_size: int,
                 usage_context: str = "server", seed: int = 0) -> None:
        draft_args = dataclasses.replace(args, model=model, enable_lora=False, max_loras=None,
                                         max_lora_rank=None, max_cpu_loras=None,
                                         tensor_parallel_size=1, speculative_config=None,
                                         quantization=None)
        self.runner = ModelRunner(draft_args, usage_context)
        if self.runner.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model: the draft model's vocabulary has "
                             f"{self.runner.vocab_size} tokens, the target's "
                             f"{target_vocab_size}: they must share the tokenizer.")
        self._free = list(range(self.runner.num_gpu_blocks - 1, -1, -1))
        self._states: dict[str, _DraftState] = {}
        self._probs: dict[str, tuple[list[int], torch.Tensor]] = {}
        self._generator = torch.Generator(device=self.runner.device).manual_seed(seed)

    def propose(self, requests: Sequence[tuple[ProposalRequest, int]]) -> dict[str, list[int]]:
        wanted = [(self._catch_up(r), r.sampling_params, n) for r, n in requests if n > 0]
        wanted = [(state, params, n) for state, params, n in wanted if state is not None]
        drafts: dict[str, list[int]] = {s.request.request_id: [] for s, _, _ in wanted}
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid in drafts}
        for step in range(max((n for _, _, n in wanted), default=0)):
            live = [(s, p) for s, p, n in wanted if n > step and self._reserve(s, 1)]
            if not live:
                break
            logits = self.runner.sample_logits([self._entry(s) for s, _ in live])
            for row, (state, params) in enumerate(live):
                token, q = self._draw(logits[row], params)
                rid = state.request.request_id
                state.num_computed = state.request.num_tokens
                state.request.all_token_ids.append(token)
                drafts[rid].append(token)
                if q is not None:
                    probs[rid].append(q)
        for rid, rows in probs.items():
            if rows:
                self._probs[rid] = (drafts[rid], torch.stack(rows))
        return {rid: d for rid, d in drafts.items() if d}

    def draft_probs(self, request_id: str, drafts: Sequence[int]) -> torch.Tensor | None:
        """The distributions ``drafts`` (a prefix of the last proposal) were drawn from."""
        proposed, probs = self._probs.pop(request_id, ([], None))
        if probs is None or list(drafts) != proposed[:len(drafts)]:
            return None
        return probs[:len(drafts)]

    def on_finished(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._release(request_id)

    def _catch_up(self, pending: ProposalRequest) -> _DraftState | None:
        """The request's draft state, its tokens set to ``pending``'s (kept KV: the prefix
        they share), with blocks for them; None when the draft cache is full."""
        tokens = list(pending.all_token_ids)
        state = self._states.get(pending.request_id)
        if state is None:
            params = SamplingParams(max_tokens=1)
            state = self._states[pending.request_id] = _DraftState(
                Request(pending.request_id, tokens[:1], params, 0.0))
        held = state.request.all_token_ids
        shared = 0
        limit = min(state.num_computed, len(tokens) - 1)  # the last one's logits are needed
        while shared < limit and held[shared] == tokens[shared]:
            shared += 1
        state.num_computed = shared
        state.request.all_token_ids = tokens
        if not self._reserve(state, 0):
            self._release(pending.request_id)
            return None
        return state

    def _reserve(self, state: _DraftState, extra: int) -> bool:
        """Blocks for the request's tokens plus ``extra``; False when the cache is full."""
        block_size = self.runner.block_size
        needed = -(-(state.request.num_tokens + extra) // block_size) - len(state.blocks)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            state.blocks.append(self._free.pop())
        return True

    def _entry(self, state: _DraftState) -> ScheduledRequest:
        start = state.num_computed
        return ScheduledRequest(state.request, start, state.request.num_tokens - start,
                                state.blocks, True)

    def _draw(self, logits: torch.Tensor, params: SamplingParams) -> tuple[int, torch.Tensor | None]:
        if params.greedy:
            return int(logits.argmax()), None
        q = target_probs(logits[None, :], [params])[0]
        race = torch.empty_like(q).exponential_(generator=self._generator)
        return int((q / race).argmax()), q

    def _release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        self._probs.pop(request_id, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))
