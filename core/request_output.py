"""What the front-ends return for a request, in vLLM's shape (``RequestOutput`` with one
``CompletionOutput`` per sample; ``EmbeddingRequestOutput`` for an embedding request)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twinserve.core.logprobs import PromptLogprobs, SampleLogprobs


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. ``text``/``token_ids`` are cumulative; ``delta_*`` hold what is
    new since the previous ``RequestOutput`` for this request (for streaming). ``logprobs``:
    one ``{token_id: Logprob}`` per generated token, holding the sampled token and the top-k."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True, frozen=True)
class KVLoadTiming:
    """A decode instance's load of a request's prompt KV from its prefill instance: start and
    end on ``time.monotonic()`` (one clock for every process of a machine, so a front can set
    them beside its own times), the bytes copied, and whether it succeeded (a failed load is
    followed by ``kv_load_failure_policy``)."""

    start: float
    end: float
    num_bytes: int
    ok: bool = True


@dataclass(slots=True)
class RequestOutput:
    """``prompt_logprobs``: one entry per prompt token (None for the first), once the prompt
    has been computed, when the request asked for them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # a ``do_remote_decode`` request's producer params, on its finished output (vLLM's field)
    kv_transfer_params: dict[str, Any] | None = None
    # a consumer's KV load of this request, on the first output after it ended
    kv_load: KVLoadTiming | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's ``EmbeddingRequestOutput``: ``outputs.embedding`` is the pooled state."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None
