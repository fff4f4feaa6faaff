"""One request of a workload: when it arrives, how long it is, and which prompt blocks it shares.

A trace carries lengths, never text, so the prompt is made up on demand by ``prompt_token_ids``:
deterministic ids in ``[LOWEST_TOKEN_ID, vocab_size)``. The first ``num_prefix_tokens`` tokens are a
function of the shared prefix block ids only (so the engine's prefix cache finds exactly the sharing the
trace records); the rest are a function of ``request_id`` (so nothing else is shared by accident).

A prefix block id stands for ``prefix_block_tokens`` tokens: 512 for Mooncake's ``hash_ids``, the whole
shared prefix for a synthetic system prompt (one id), 16 for hand-made block lists. Token ``p`` of the
prefix is ``mix(seed(prefix_blocks[p // prefix_block_tokens]) + p % prefix_block_tokens)``, so the tokens
depend on the block id and the offset only, never on the engine's KV block size; the last block may cover
fewer tokens than ``prefix_block_tokens`` (it stops at ``input_tokens``). Keeping the trace's own block
granularity (instead of expanding every 512-token id into 32 ids of 16 tokens) keeps the Mooncake trace
at ~0.3 M ints in memory rather than ~9 M, and produces the same tokens for every shared block.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

LOWEST_TOKEN_ID = 16  # ids below this are left to special tokens (BOS, EOS, PAD, ...)
MAX_BLOCK_ID = 2**63 - 1

_U64 = np.uint64
_MIN_PRIORITY = -(2**63)
_PREFIX_SALT = _U64(0x5AFE_B10C_0000_0001)
# splitmix64's constants as numpy scalars, built once: converting a Python int on every ufunc call
# costs more than the arithmetic on a prompt's ids.
_GAMMA, _M1, _M2 = _U64(0x9E3779B97F4A7C15), _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)
_S30, _S27, _S31 = _U64(30), _U64(27), _U64(31)
_LOWEST = _U64(LOWEST_TOKEN_ID)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array, in place (wrapping arithmetic, vectorised)."""
    t = np.empty_like(z)  # one scratch array for the three shifts
    z += _GAMMA
    z ^= np.right_shift(z, _S30, out=t)
    z *= _M1
    z ^= np.right_shift(z, _S27, out=t)
    z *= _M2
    z ^= np.right_shift(z, _S31, out=t)
    return z


def stable_seed(text: str) -> int:
    """A 64-bit seed from a string, identical across processes (unlike the salted ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """A request spec from a trace or a synthetic workload; times in seconds from the trace start."""

    request_id: str
    arrival_time: float
    input_tokens: int
    output_tokens: int
    tenant: str = "default"
    priority: int = 0
    prefix_blocks: tuple[int, ...] = ()  # shared prompt blocks, in prompt order
    prefix_block_tokens: int = 16  # tokens each prefix block id stands for
    lora: str | None = None  # the LoRA adapter's name (None: the base model)

    def __post_init__(self) -> None:
        # The common row in one test, true only where every check of ``_check_fields`` passes
        # (exact types, no prefix blocks): a trace load builds tens of thousands of these.
        if (type(self.request_id) is str and self.request_id and type(self.arrival_time) is float
                and 0.0 <= self.arrival_time < math.inf and type(self.input_tokens) is int
                and self.input_tokens >= 1 and type(self.output_tokens) is int
                and self.output_tokens >= 1 and type(self.priority) is int
                and self.priority >= _MIN_PRIORITY and type(self.prefix_block_tokens) is int
                and self.prefix_block_tokens >= 1 and type(self.tenant) is str and self.tenant
                and self.prefix_blocks == () and self.lora is None):
            return
        self._check_fields()

    def _check_fields(self) -> None:
        """Every field's check (the plain path of ``__post_init__``)."""
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}.")
        if not isinstance(self.arrival_time, (int, float)) or not math.isfinite(self.arrival_time) \
                or self.arrival_time < 0:
            raise ValueError(f"arrival_time must be a finite number >= 0, got {self.arrival_time!r}.")
        _check_count("input_tokens", self.input_tokens, 1)
        _check_count("output_tokens", self.output_tokens, 1)
        _check_count("priority", self.priority, _MIN_PRIORITY)
        _check_count("prefix_block_tokens", self.prefix_block_tokens, 1)
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError(f"tenant must be a non-empty string, got {self.tenant!r}.")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"lora must be a non-empty adapter name or None, got {self.lora!r}.")
        self._check_prefix_blocks()

    def _check_prefix_blocks(self) -> None:
        if not isinstance(self.prefix_blocks, tuple):
            raise ValueError(f"prefix_blocks must be a tuple, got {type(self.prefix_blocks).__name__}.")
        blocks = self.prefix_blocks
        # Whole-tuple checks in C: this runs for every copy a transform makes of a long Mooncake prompt.
        if blocks and (not set(map(type, blocks)) <= {int}
                       or min(blocks) < 0 or max(blocks) > MAX_BLOCK_ID):
            raise ValueError(f"prefix_blocks must hold ints in [0, 2**63), got {blocks!r}.")
        # Every block must cover at least one prompt token; the last one may be partial.
        if (len(self.prefix_blocks) - 1) * self.prefix_block_tokens >= self.input_tokens:
            raise ValueError(
                f"prefix_blocks: {len(self.prefix_blocks)} blocks of {self.prefix_block_tokens} tokens "
                f"do not fit in input_tokens={self.input_tokens}.")

    @property
    def num_prefix_tokens(self) -> int:
        """Prompt tokens that come from the shared prefix blocks."""
        return min(len(self.prefix_blocks) * self.prefix_block_tokens, self.input_tokens)

    def prompt_token_ids(self, vocab_size: int, block_size: int = 16) -> list[int]:
        """Exactly ``input_tokens`` deterministic ids in ``[LOWEST_TOKEN_ID, vocab_size)``.

        ``block_size`` (the engine's KV block size) is accepted so callers may pass it, but the tokens
        do not depend on it: the same request gives the same prompt under any engine setting.
        """
        _check_count("block_size", block_size, 1)
        return _ids_view(_prompt_ids((self,), vocab_size)).tolist()


def _ids_view(ids: np.ndarray) -> memoryview:
    """A memoryview of ``ids``: it converts them to Python ints in about half the time of
    ``ndarray.tolist``."""
    # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12; on 3.11 ndarray still
    # exports the buffer protocol (in C), so the view is valid
    return memoryview(ids)  # type: ignore[arg-type]


def _prompt_ids(requests: Sequence[TraceRequest], vocab_size: int,
                starts: Sequence[int] | np.ndarray | None = None,
                stops: Sequence[int] | np.ndarray | None = None,
                seeds: np.ndarray | None = None) -> np.ndarray:
    """The prompts of ``requests`` back to back, as int64 ids (every id is below 2**63); with
    ``starts``/``stops``, only each prompt's ids at positions ``[start, stop)``; ``seeds``:
    their ``_request_seeds``, when already made."""
    _check_count("vocab_size", vocab_size, LOWEST_TOKEN_ID + 1)
    n = len(requests)
    lo = np.zeros(n, np.int64) if starts is None else np.asarray(starts, np.int64)
    hi = (np.fromiter((r.input_tokens for r in requests), np.int64, n) if stops is None
          else np.asarray(stops, np.int64))
    lengths = hi - lo
    offsets = np.cumsum(lengths) - lengths
    keys = np.arange(int(lengths.sum()), dtype=_U64)
    keys -= np.repeat((offsets - lo).astype(_U64), lengths)  # positions within each prompt
    if seeds is None:
        seeds = _request_seeds(requests)
    keys += np.repeat(seeds, lengths)  # wrapping: the request's own tokens
    for r, off, a, b in zip(requests, offsets.tolist(), lo.tolist(), hi.tolist()):
        end = min(b, r.num_prefix_tokens) if r.prefix_blocks else 0
        if a < end:  # the shared part: a function of the block id and the offset only
            per_block = _U64(r.prefix_block_tokens)
            block_seeds = _mix(np.array(r.prefix_blocks, dtype=_U64) ^ _PREFIX_SALT)
            head = np.arange(a, end, dtype=_U64)
            keys[off:off + end - a] = block_seeds[head // per_block] + head % per_block
    ids = _mix(keys)
    ids %= _U64(vocab_size - LOWEST_TOKEN_ID)
    ids += _LOWEST
    return ids.view(np.int64)


def _request_seeds(requests: Sequence[TraceRequest]) -> np.ndarray:
    """Each request's ``stable_seed`` of its id, as uint64."""
    return np.fromiter((stable_seed(r.request_id) for r in requests), _U64, len(requests))


def prompt_ids_slice(request: TraceRequest, vocab_size: int, start: int, stop: int) -> list[int]:
    """``request.prompt_token_ids(vocab_size)[start:stop]`` without the rest of the prompt
    (``0 <= start <= stop <= input_tokens``)."""
    return _ids_view(_prompt_ids((request,), vocab_size, [start], [stop])).tolist()


_KEY_SALT = _U64(0xB10C_CA5E_0000_0002)
_PREFIX_KEY = 0x5AFE_B10C_0000_0003  # an int: str hashes change per process


@dataclass(slots=True, frozen=True)
class PromptParts:
    """What a lazy prompt holds without its ids (``iter_prompt_parts``): the ids of its last,
    partly full block (from ``tail_start``) and a prefix-cache key per full block."""

    tail_start: int
    tail: list[int]
    keys: list[int]


def iter_prompt_parts(requests: Iterable[TraceRequest], vocab_size: int, block_size: int,
                      batch_requests: int = 4096) -> Iterator[PromptParts]:
    """Each request's ``PromptParts`` for KV blocks of ``block_size`` tokens, in order.

    Key of full block ``i`` (tokens ``[0, E)``, ``E = (i + 1) * block_size``): where those
    tokens lie within the shared prefix, a hash of the prefix block ids that make them (and
    ``E``, ``prefix_block_tokens``), as every request sharing them computes; where the block
    holds the prefix's end and the request's first own ids, a hash of the prefix's blocks, its
    length and those own ids (two prompts' few own ids there coincide about once in ``vocab``
    pairs per id, and the plain ids then share the block); past it, a function of the
    request's own seed and ``i`` (splitmix64, a bijection: distinct for distinct requests and
    blocks), as its own tokens are. So two keys are equal exactly where the two prompts' first
    ``E`` ids are (up to 64-bit collisions, as for any hash, and to a whole block of own ids
    colliding, about ``vocab ** -block_size``)."""
    _check_count("block_size", block_size, 1)
    batch: list[TraceRequest] = []
    for r in requests:
        batch.append(r)
        if len(batch) >= batch_requests:
            yield from _prompt_parts(batch, vocab_size, block_size)
            batch = []
    if batch:
        yield from _prompt_parts(batch, vocab_size, block_size)


def _prompt_parts(requests: list[TraceRequest], vocab_size: int,
                  block_size: int) -> Iterator[PromptParts]:
    n = len(requests)
    lengths = np.fromiter((r.input_tokens for r in requests), np.int64, n)
    num_full = lengths // block_size
    tail_starts = num_full * block_size
    seeds = _request_seeds(requests)
    tails = _ids_view(_prompt_ids(requests, vocab_size, tail_starts, lengths, seeds))
    # the own ids of the full block that holds the shared prefix's end, where there is one
    shared = np.fromiter((r.num_prefix_tokens if r.prefix_blocks else 0 for r in requests),
                         np.int64, n)
    mixed_ends = np.minimum(-(-shared // block_size) * block_size, tail_starts)
    mixed_starts = np.minimum(shared, mixed_ends)
    mixed = _ids_view(_prompt_ids(requests, vocab_size, mixed_starts, mixed_ends, seeds))
    offsets = np.cumsum(num_full) - num_full
    keys = np.arange(int(num_full.sum()), dtype=_U64)
    keys -= np.repeat(offsets.astype(_U64), num_full)  # block index within each prompt
    keys += np.repeat(_mix(seeds ^ _KEY_SALT), num_full)
    all_keys = _ids_view(_mix(keys)).tolist()
    t = m = 0
    for r, start, full, off, own in zip(requests, tail_starts.tolist(), num_full.tolist(),
                                        offsets.tolist(), (mixed_ends - mixed_starts).tolist()):
        mine = all_keys[off:off + full]
        if r.prefix_blocks:
            per, pre, num_shared = r.prefix_block_tokens, r.prefix_blocks, r.num_prefix_tokens
            whole = min(full, num_shared // block_size)
            for i in range(whole):
                end = (i + 1) * block_size
                mine[i] = hash((_PREFIX_KEY, per, end, pre[:-(-end // per)]))
            if own:
                mine[whole] = hash((_PREFIX_KEY, per, num_shared, pre[:-(-num_shared // per)],
                                    tuple(mixed[m:m + own].tolist())))
                m += own
        size = r.input_tokens - start
        yield PromptParts(start, tails[t:t + size].tolist(), mine)
        t += size


def iter_prompt_token_ids(requests: Iterable[TraceRequest], vocab_size: int,
                          batch_tokens: int = 1 << 16) -> Iterator[list[int]]:
    """Each request's ``prompt_token_ids(vocab_size)``, in order, made in batches of about
    ``batch_tokens`` tokens: one vectorised pass per batch rather than a dozen numpy calls per
    prompt (a replay makes tens of thousands of prompts)."""
    _check_count("batch_tokens", batch_tokens, 1)
    batch: list[TraceRequest] = []
    num_tokens = 0
    for r in requests:
        batch.append(r)
        num_tokens += r.input_tokens
        if num_tokens >= batch_tokens:
            yield from _split_prompts(batch, vocab_size)
            batch, num_tokens = [], 0
    if batch:
        yield from _split_prompts(batch, vocab_size)


def _split_prompts(requests: list[TraceRequest], vocab_size: int) -> Iterator[list[int]]:
    ids = _ids_view(_prompt_ids(requests, vocab_size))
    start = 0
    for r in requests:
        yield ids[start:start + r.input_tokens].tolist()
        start += r.input_tokens
