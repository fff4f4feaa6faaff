"""The small dataclasses that cross the step seam:

    out  = scheduler.schedule(now)                             # SchedulerOutput
    res  = backend.execute(out)                                # ModelRunnerOutput
    outs = scheduler.update_from_output(out, res, now_after)   # list[EngineCoreOutput]

A backend performs, in this order: swap-outs, swap-ins, block copies (copy-on-write), then one
forward pass over ``scheduled`` (prefill chunks and decodes flattened together), sampling a token
for every entry whose ``sample`` is true.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twinserve.core.logprobs import TokenLogprobs
from twinserve.core.request import Request

if TYPE_CHECKING:
    from twinserve.core.kv_connector import KVConnectorMetadata, KVConnectorOutput


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens ``[start, start + num_new_tokens)`` of
    ``request.all_token_ids`` are computed, their KV written into ``block_ids``.

    ``block_ids`` is the request's live block table (read-only for the backend, valid until
    ``update_from_output``). ``sample`` is true when this chunk reaches the end of the known tokens,
    so the backend must sample the next token from the logits of the last position. A hybrid KV
    layout (several KV cache groups) adds every group's live table in ``group_block_ids``
    (``group_block_ids[0] is block_ids``); with one group it is empty.

    An entry is valid until the next ``schedule``: the scheduler updates a running decode's entry
    in place from step to step instead of building a new one (copy it to keep it longer).
    """

    request: Request
    start: int
    num_new_tokens: int
    block_ids: list[int]
    sample: bool
    group_block_ids: tuple[list[int], ...] = ()
    # Speculation: the drafts this entry verifies (``num_new_tokens == 1 + len(spec_token_ids)``)
    # and how many drafts the backend proposes for the request after sampling (0: none).
    spec_token_ids: Sequence[int] = ()  # a list when there are drafts
    num_draft_next: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        spec = self.spec_token_ids
        if spec:  # the drafts are not the request's tokens (yet): they follow its last one
            return self.request.all_token_ids[self.start:self.start + 1] + list(spec)
        return self.request.all_token_ids[self.start:self.start + self.num_new_tokens]

    @property
    def is_prefill(self) -> bool:
        return self.start < self.request.num_prompt_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes. ``num_prefill_tokens``/``num_decode_tokens`` and the context sums
    feed the simulator's cost model; a decode is a request past its prompt. An entry verifying
    k drafts is one decode sequence of 1 + k decode tokens (``num_spec_tokens`` counts the k)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_seqs: int = 0
    num_decode_seqs: int = 0
    # Sum over scheduled requests of the context each new token attends to (attention cost).
    sum_context_tokens: int = 0
    sum_decode_context_tokens: int = 0  # the decode part of sum_context_tokens
    # Longest context among the decodes: a backend that pads decode attention to it reads
    # num_decode_seqs * max_decode_context KV tokens.
    max_decode_context: int = 0
    # Prefill chunks that follow computed tokens (a cached prefix or the prompt's earlier chunks):
    # attention against a prefix runs another kernel than a chunk's from position 0 (on the CPU a
    # masked one, with a cost per chunk; docs/fidelity.md, "The cost model's terms").
    num_prefix_chunks: int = 0
    # Sum over prefill chunks of the tokens before each (its prefix): the masked kernel gathers and
    # reads that prefix once per chunk, whatever the chunk's length.
    sum_prefix_context_tokens: int = 0
    # Sum over prefill chunks of chunk tokens x (prefix + chunk tokens): the query-by-key rectangle
    # of each chunk. The CPU's attention kernels compute all of it, masked half included (a fresh
    # 512-token prompt's causal flash kernel took about as long as the masked one over the square).
    sum_prefill_attention_area: int = 0
    # Draft tokens verified this step (speculative decoding), part of num_decode_tokens.
    num_spec_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that left since the previous step (finished or aborted): backends drop their state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Block copies, rare: the shared empty tuple unless the step has some (saves three lists a
    # step; the scheduler sets its own lists when it has copies to ask for).
    blocks_to_swap_out: Sequence[tuple[int, int]] = ()  # (device, host)
    blocks_to_swap_in: Sequence[tuple[int, int]] = ()   # (host, device)
    blocks_to_copy: Sequence[tuple[int, int]] = ()      # (src, dst) device
    # LoRA adapters made resident this step, (adapter name, device slot), in order: a backend
    # loads them before the forward pass (a later load into the same slot replaces an earlier).
    lora_loads: Sequence[tuple[str, int]] = ()
    # The KV connector's orders to its worker side for this step (None: no connector).
    kv_connector_metadata: KVConnectorMetadata | None = None


# The step totals the scheduler fills in every SchedulerOutput: what the simulator's cost model
# reads, what calibration records per measured step.
AGGREGATE_FIELDS: tuple[str, ...] = (
    "total_num_scheduled_tokens", "num_prefill_tokens", "num_decode_tokens", "num_prefill_seqs",
    "num_decode_seqs", "sum_context_tokens", "sum_decode_context_tokens", "max_decode_context",
    "num_prefix_chunks", "sum_prefix_context_tokens", "sum_prefill_attention_area",
    "num_spec_tokens",
)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Tokens sampled by the backend, keyed by request id, for entries with ``sample`` set.
    ``logprobs`` maps request id to one ``TokenLogprobs`` per sampled token (requests that asked
    for logprobs). In the step that completes a prompt: ``prompt_logprobs`` (requests with
    ``prompt_logprobs``) holds one entry per prompt token after the first, and ``pooled``
    (requests with ``pooling_params``) the prompt's pooled, normalised hidden state.

    Speculation: for an entry verifying k drafts, ``sampled_token_ids`` holds the accepted
    drafts and then one sampled token (1..k + 1 tokens); ``spec_token_ids`` the drafts proposed
    for the next step (at most the entry's ``num_draft_next``; fewer or none is fine)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The KV connector's worker side's report (transfers finished or failed); None: no connector.
    kv_connector_output: KVConnectorOutput | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """A request's progress after one step: the new tokens (for streaming) and, when it ended,
    why. ``error`` is set when the request ended without running (e.g. prompt too long)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    pooled: list[float] | None = None
    # On the finishing output of a ``do_remote_decode`` request: the params a consumer needs to
    # load its KV (``core.kv_connector``); the API returns them as vLLM does.
    kv_transfer_params: dict[str, Any] | None = None


def attach_prompt_results(output: EngineCoreOutput, result: ModelRunnerOutput) -> None:
    """Copies a request's prompt logprobs and pooled state (the step that completed its
    prompt) from the backend's result into its output."""
    rid = output.request_id
    output.prompt_logprobs = result.prompt_logprobs.get(rid)
    output.pooled = result.pooled.get(rid)
