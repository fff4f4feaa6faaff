"""One request: its tokens, its progress through the engine and the timestamps the metrics need."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from twinserve.core.pooling_params import PoolingParams
from twinserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from twinserve.core.outputs import ScheduledRequest


class RequestStatus(enum.IntEnum):
    """Lifecycle states. Every state after ``PREEMPTED`` is finished, so ``is_finished`` is one compare."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue; KV recomputed or held in the host (swap) pool
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6  # rejected before it ever ran (prompt too long)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


# Enum class attributes cost ~0.1 us a lookup on Python 3.11; ``is_finished`` runs per step.
_PREEMPTED = RequestStatus.PREEMPTED

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


@dataclass(slots=True, eq=False)
class Request:
    """A request as the scheduler sees it. Identity equality: two requests are never "equal".

    ``num_tokens`` counts prompt plus output; the scheduler hands out tokens until
    ``num_computed_tokens`` catches up with it. ``num_cached_tokens`` is the prefix-cache hit
    at first admission (``None`` until then).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    priority: int = 0
    tenant: str = "default"
    lora: str | None = None
    # Extra data the policies may read (length hints, deadlines); never interpreted by core.
    hints: dict[str, float] = field(default_factory=dict)
    # n > 1: children are forked from the parent after its prefill (see KVCacheManager.fork).
    parent_id: str | None = None
    index: int = 0
    # An embedding request: the backend returns the prompt's pooled hidden state.
    pooling_params: PoolingParams | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    swapped_out: bool = False
    stop_reason: int | str | None = None
    block_hashes: list[int] = field(default_factory=list)
    num_prompt_tokens: int = field(init=False, default=0)
    # Output length at which the request is capped (max_tokens, or what max_model_len leaves);
    # set by the scheduler when the request is added.
    max_output_tokens: int = field(init=False, default=0)
    # Token ids that may end the request (stop_token_ids, plus EOS unless ignore_eos): one set
    # lookup per sampled token on the scheduler's hot path.
    stop_ids: frozenset[int] = field(init=False, default=frozenset())

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    admitted_time: float | None = None
    # The scheduler's entry for this request while it runs as a decode, updated in place from
    # step to step (one attribute read per decode and step, where a dict would need a lookup).
    decode_entry: ScheduledRequest | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.request_id or not isinstance(self.request_id, str):
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}.")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty.")
        if self.arrival_time != self.arrival_time or self.arrival_time < 0:
            raise ValueError(f"arrival_time must be a non-negative number, got {self.arrival_time}.")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}.")
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        params = self.sampling_params
        eos = () if self.eos_token_id is None or params.ignore_eos else (self.eos_token_id,)
        self.stop_ids = frozenset((*params.stop_token_ids, *eos))

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > _PREEMPTED

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
