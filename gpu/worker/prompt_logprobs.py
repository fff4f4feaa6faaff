"""Prompt logprobs across prefill chunks: each chunk's positions give the logprobs of the prompt
tokens they predict, gathered per request until the chunk that completes the prompt, whose
step returns them all (``ModelRunnerOutput.prompt_logprobs``).

Prefix-cache hits would leave positions without logits, so the scheduler reads no cached
blocks for these requests (``SamplingParams.skip_reading_prefix_cache``, as vLLM v1 does). A
preemption by recompute restarts the prompt at 0, which starts the gathering again; the samples
of ``n > 1`` forked from the parent share its prompt, whose output carries them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from twinserve.core.logprobs import TokenLogprobs
from twinserve.core.outputs import ScheduledRequest
from twinserve.gpu.worker.logprobs import MAX_ROWS, token_logprobs


class PromptLogprobsCollector:
    """Per-request partial results between the chunks of a prompt."""

    def __init__(self) -> None:
        self._partial: dict[str, list[TokenLogprobs]] = {}

    def free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._partial.pop(rid, None)

    def collect(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor,
                compute_logits: Callable[[torch.Tensor], torch.Tensor],
                ) -> dict[str, list[TokenLogprobs]]:
        """``hidden[T, H]`` holds the step's rows in ``scheduled`` order; returns the complete
        prompt logprobs of the requests whose prompt this step completed."""
        done: dict[str, list[TokenLogprobs]] = {}
        row = 0
        for sr in scheduled:
            first_row, row = row, row + sr.num_new_tokens
            request = sr.request
            k = request.sampling_params.prompt_logprobs
            if k is None or request.parent_id is not None or request.output_token_ids:
                continue
            num_prompt = request.num_prompt_tokens
            if sr.start >= num_prompt:
                continue
            if sr.start == 0:
                self._partial[request.request_id] = []
            partial = self._partial.setdefault(request.request_id, [])
            end = min(sr.start + sr.num_new_tokens, num_prompt - 1)  # the last predicts output
            targets = request.prompt_token_ids[sr.start + 1:end + 1]
            for lo in range(0, len(targets), MAX_ROWS):
                chunk = targets[lo:lo + MAX_ROWS]
                logits = compute_logits(hidden[first_row + lo:first_row + lo + len(chunk)])
                partial.extend(token_logprobs(logits, chunk, [k] * len(chunk)))
            if sr.start + sr.num_new_tokens >= num_prompt:
                done[request.request_id] = self._partial.pop(request.request_id)
        return done
