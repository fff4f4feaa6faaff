"""One request: its tokens, its progress through the engine and the timestamps the metrics need."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any, overload

from twinserve.core.pooling_params import PoolingParams
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.token_times import TokenTimes

if TYPE_CHECKING:
    from twinserve.core.outputs import ScheduledRequest


class RequestStatus(enum.IntEnum):
    """Lifecycle states. Every state after ``WAITING_FOR_REMOTE_KVS`` is finished, so
    ``is_finished`` is one compare."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue; KV recomputed or held in the host (swap) pool
    # Out of the waiting queue, holding blocks that a KV connector fills (vLLM's name); neither
    # running nor scheduled until the load completes.
    WAITING_FOR_REMOTE_KVS = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_IGNORED = 7  # rejected before it ever ran (prompt too long)
    FINISHED_ERROR = 8  # a remote KV load failed under kv_load_failure_policy "fail"

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.WAITING_FOR_REMOTE_KVS

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


# Enum class attributes cost ~0.1 us a lookup on Python 3.11; ``is_finished`` runs per step.
_LAST_UNFINISHED = RequestStatus.WAITING_FOR_REMOTE_KVS

_NO_STOP_IDS: frozenset[int] = frozenset()

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class LazyPrompt(Sequence[int]):
    """A prompt whose ids are made on demand, with the prefix-cache keys of its full blocks.

    A replay's synthetic prompts (``traces``) are functions of the request's identity: their
    ids need not exist as Python lists for the scheduler to count, slice and hash them. ``make``
    returns the ids in ``[start, stop)``; ``tail`` holds the ids from ``tail_start`` on
    (the last, partly full block, which the decodes hash with their tokens) without a call.
    ``keys``: the key of each full block of ``key_block_size`` tokens, standing in for the hash
    chain over its ids (``core.block_hash``): equal keys exactly where the ids before the block's
    end are equal (the maker's promise), so the cache hits and misses as with the ids."""

    __slots__ = ("_len", "_make", "_tail_start", "_tail", "key_block_size", "keys", "own_ids_from")

    def __init__(self, length: int, make: Callable[[int, int], list[int]], tail_start: int,
                 tail: list[int], key_block_size: int, keys: list[int],
                 own_ids_from: int | None = None) -> None:
        self._len, self._make = length, make
        self._tail_start, self._tail = tail_start, tail
        self.key_block_size, self.keys = key_block_size, keys
        # The ids from this position on are this prompt's own: no other request's prompt holds
        # them (the maker's promise; None: no such promise).
        self.own_ids_from = own_ids_from

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return self[start:stop][::step] if step > 0 else list(self)[index]
            return self.ids(start, stop)
        i = index + self._len if index < 0 else index
        if not 0 <= i < self._len:
            raise IndexError("prompt index out of range")
        return self.ids(i, i + 1)[0]

    def ids(self, start: int, stop: int) -> list[int]:
        """The ids in ``[start, stop)`` (clipped to the prompt)."""
        stop = min(stop, self._len)
        if start >= stop:
            return []
        if start >= self._tail_start:
            return self._tail[start - self._tail_start:stop - self._tail_start]
        return self._make(start, stop)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids(0, self._len))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, LazyPrompt)):
            return len(other) == self._len and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class RepeatedTokenIds(Sequence[int]):
    """``output_token_ids`` of a request whose output tokens are all one id: their count.

    The twin "samples" one token for every request and step (``simulator.engine``), so a
    replayed request's outputs are that id, hundreds of times: a list of them would be grown,
    copied at each reallocation and read back at its release, all for nothing. Supports what
    the engine does with an output list: ``len``, indexing and slices, ``append``, ``extend``
    and ``+=``; any other id is refused (``ValueError``)."""

    __slots__ = ("token", "n")

    def __init__(self, token: int, n: int = 0) -> None:
        if n < 0:
            raise ValueError(f"a count of token ids cannot be negative, got {n}.")
        self.token, self.n = token, n

    def __len__(self) -> int:
        return self.n

    def append(self, token: int) -> None:
        if token != self.token:
            self._refuse(token)
        self.n += 1

    def extend(self, tokens: Sequence[int]) -> None:
        if tokens.count(self.token) != len(tokens):
            self._refuse(next(t for t in tokens if t != self.token))
        self.n += len(tokens)

    def __iadd__(self, tokens: Sequence[int]) -> RepeatedTokenIds:
        self.extend(tokens)
        return self

    def _refuse(self, token: int) -> None:
        raise ValueError(f"an output list of one repeated token id ({self.token}) cannot take "
                         f"token id {token!r}.")

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return [self.token] * len(range(*index.indices(self.n)))
        if not -self.n <= index < self.n:
            raise IndexError("token index out of range")
        return self.token

    def __iter__(self) -> Iterator[int]:
        return repeat(self.token, self.n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RepeatedTokenIds):
            return other.n == self.n and (not self.n or other.token == self.token)
        if isinstance(other, (list, tuple)):
            return len(other) == self.n and other.count(self.token) == self.n
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RepeatedTokenIds(token={self.token}, n={self.n})"


class LazyTokenIds(Sequence[int]):
    """``all_token_ids`` of a request with a ``LazyPrompt``: the prompt, then ``outputs``, the
    request's own ``output_token_ids`` (the same object, not a copy: such a request's tokens
    after its prompt are its outputs). Supports what the engine does with a token list:
    ``len``, slices, ``append`` and ``+=``.

    The engine appends each token to the outputs, then to ``all_token_ids``; here the second
    append only counts the tokens, and raises where the outputs do not hold them already (a
    token added here alone would otherwise be lost). One growing list of token ids a request,
    where two grew side by side with the same tokens. Outputs that are a ``RepeatedTokenIds``
    (the twin's) are counted by reading their count, without a second Python call."""

    __slots__ = ("prompt", "outputs", "_num_prompt", "_num_added", "_repeated")

    def __init__(self, prompt: LazyPrompt,
                 outputs: list[int] | RepeatedTokenIds | None = None) -> None:
        self.prompt = prompt
        self.outputs: list[int] | RepeatedTokenIds = [] if outputs is None else outputs
        self._repeated = outputs if type(outputs) is RepeatedTokenIds else None
        # a LazyPrompt's length never changes: kept here, ``len`` (which the scheduler asks of
        # every running request every step) is one Python call, not two
        self._num_prompt = len(prompt)
        self._num_added = len(self.outputs)  # the outputs this sequence was told of

    def __len__(self) -> int:
        repeated = self._repeated
        return self._num_prompt + (repeated.n if repeated is not None else len(self.outputs))

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        n = self._num_prompt
        if isinstance(index, slice):
            start, stop, step = index.indices(n + len(self.outputs))
            if step != 1:
                return list(self)[index]
            if start >= n:
                return self.outputs[start - n:stop - n]
            return self.prompt.ids(start, stop) + self.outputs[:max(stop - n, 0)]
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError("token index out of range")
        return self.outputs[i - n] if i >= n else self.prompt[i]

    def append(self, token: int) -> None:
        self._num_added += 1
        repeated = self._repeated
        if self._num_added != (repeated.n if repeated is not None else len(self.outputs)):
            self._out_of_step()

    def extend(self, tokens: Sequence[int]) -> None:
        self._num_added += len(tokens)
        repeated = self._repeated
        if self._num_added != (repeated.n if repeated is not None else len(self.outputs)):
            self._out_of_step()

    def __iadd__(self, tokens: Sequence[int]) -> LazyTokenIds:
        self.extend(tokens)
        return self

    def _out_of_step(self) -> None:
        added, held = self._num_added, len(self.outputs)
        self._num_added = held
        raise RuntimeError(
            f"a lazy prompt's all_token_ids are its prompt and its output_token_ids: {added} "
            f"tokens added after the prompt, {held} outputs (append to output_token_ids first)")

    def __iter__(self) -> Iterator[int]:
        return chain(self.prompt, self.outputs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, LazyTokenIds)):
            return len(other) == len(self) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


@dataclass(slots=True, eq=False)
class Request:
    """A request as the scheduler sees it. Identity equality: two requests are never "equal".

    ``num_tokens`` counts prompt plus output; the scheduler hands out tokens until
    ``num_computed_tokens`` catches up with it. ``num_cached_tokens`` is the prefix-cache hit
    at first admission (``None`` until then).
    """

    request_id: str
    # A list, or a ``LazyPrompt`` (a replay's synthetic prompt: ids made on demand)
    prompt_token_ids: list[int] | LazyPrompt
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
    # Disaggregated prefill/decode (vLLM's keys, ``core.kv_connector``): a producer's
    # ``{"do_remote_decode": True}`` or a consumer's ``{"do_remote_prefill": True, ...}``.
    kv_transfer_params: dict[str, Any] | None = None

    status: RequestStatus = RequestStatus.WAITING
    # A list, or a ``RepeatedTokenIds`` (a replay's outputs, one token id: their count)
    output_token_ids: list[int] | RepeatedTokenIds = field(default_factory=list)
    all_token_ids: list[int] | LazyTokenIds = field(default_factory=list)
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
    # when each output token was sampled: a request has hundreds, handed over a run at a time
    # by the twin (``core.decode_run``) and read once, by its record
    token_times: TokenTimes = field(default_factory=TokenTimes)
    admitted_time: float | None = None
    # Speculative decoding: the drafts proposed for the next step (empty: none; cleared when the
    # request is preempted or finishes) and the request's verification counts (vLLM's names).
    # (a shared empty tuple until drafts come: no list per request for the collector to track)
    spec_token_ids: Sequence[int] = ()
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # The scheduler's entry for this request while it runs as a decode, updated in place from
    # step to step (one attribute read per decode and step, where a dict would need a lookup).
    decode_entry: ScheduledRequest | None = field(default=None, init=False, repr=False)
    # From this position on the request's tokens are its own (its ``LazyPrompt``'s promise, one
    # sequence, n == 1): a full block holding one can be found in the prefix cache by this
    # request alone, so the KV manager registers such blocks only if it is preempted (its one
    # chance to look them up again) and then clears this. None: every block is registered.
    own_ids_from: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.request_id or not isinstance(self.request_id, str):
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}.")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty.")
        if self.arrival_time != self.arrival_time or self.arrival_time < 0:
            raise ValueError(f"arrival_time must be a non-negative number, got {self.arrival_time}.")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}.")
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise ValueError("kv_transfer_params must be a mapping, got "
                             f"{type(self.kv_transfer_params).__name__}.")
        prompt = self.prompt_token_ids
        if type(prompt) is LazyPrompt:
            self.all_token_ids = LazyTokenIds(prompt, self.output_token_ids)
            if self.sampling_params.n == 1 and self.parent_id is None:
                self.own_ids_from = prompt.own_ids_from
        else:
            self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        params = self.sampling_params
        eos = () if self.eos_token_id is None or params.ignore_eos else (self.eos_token_id,)
        stop = (*params.stop_token_ids, *eos)
        # (none: one shared empty set, read by every decode run: an empty frozenset is a new
        # object per call)
        self.stop_ids = frozenset(stop) if stop else _NO_STOP_IDS

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > _LAST_UNFINISHED

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
