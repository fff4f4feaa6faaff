"""Sampling parameters with vLLM's field names, defaults and validation.

vLLM's fields that twinserve does not implement yet are accepted at their default only, so that
code written for vLLM fails loudly (``ValueError`` naming the field) instead of being silently
sampled without them; see ``UNSUPPORTED``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twinserve.core.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
# Bounds on the stop list: each stop string is matched against every request's output text, so
# a client must not be able to make one request (or its neighbours' steps) slow by sending many.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256

# vLLM's SamplingParams fields that twinserve does not implement: name -> (what the field asks
# for, the values that mean "not used"). The first value of each is the dataclass default.
UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "best_of": ("best-of-n sampling (only best_of == n is accepted)", (None,)),
    "use_beam_search": ("beam search", (False,)),
    "length_penalty": ("beam search's length penalty", (1.0,)),
    "early_stopping": ("beam search's early stopping", (False,)),
    "logprob_token_ids": ("logprobs of chosen token ids", (None,)),
    "flat_logprobs": ("flat logprobs", (False,)),
    "detokenize": ("token-id-only outputs (detokenize=False)", (True,)),
    "spaces_between_special_tokens": ("spaces_between_special_tokens=False", (True,)),
    "output_kind": ("output kinds (generate returns final outputs)", (None,)),
    "stream_interval": ("stream intervals", (None, 1)),
    "guided_decoding": ("guided (constrained) decoding", (None,)),
    "extra_args": ("extra arguments for custom sampling extensions", (None, {})),
    "thinking_token_budget": ("thinking token budgets", (None, -1)),
    "repetition_detection": ("repetition detection", (None,)),
}
_UNSUPPORTED_DEFAULTS = tuple(absent[0] for _, absent in UNSUPPORTED.values())


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's output. Invalid values raise ``ValueError`` naming the field.

    ``temperature == 0`` means greedy. ``max_tokens=None`` means "up to ``max_model_len``".
    Attributes may be changed after construction; ``validate()`` checks them again (the engines
    call it when a request is added, so a bad value never reaches a step).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # The logprobs of each prompt token (top-k plus the prompt's own token; the first is None).
    prompt_logprobs: int | None = None
    # Keep only the last k prompt tokens (-1: the last max_model_len - 1).
    truncate_prompt_tokens: int | None = None
    # Strings whose token sequences may not be generated (vLLM's: the last token of a bad word
    # is masked when the tokens before it were just generated); tokenized by the engine.
    bad_words: list[str] | None = None
    # Python callables (output_token_ids, logits[V]) -> logits[V], or (prompt_token_ids,
    # output_token_ids, logits[V]) -> logits[V] (vLLM v0's), applied before everything else.
    logits_processors: list[Any] | None = field(default=None, repr=False)
    # None: True when prompt_logprobs is set (the cached prompt positions have no logits).
    skip_reading_prefix_cache: bool | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Constrained decoding (core/structured_outputs.py); a dict of its fields is accepted.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's fields twinserve does not implement: accepted at their default only (UNSUPPORTED).
    best_of: int | None = field(default=None, repr=False)
    use_beam_search: bool = field(default=False, repr=False)
    length_penalty: float = field(default=1.0, repr=False)
    early_stopping: bool = field(default=False, repr=False)
    logprob_token_ids: list[int] | None = field(default=None, repr=False)
    flat_logprobs: bool = field(default=False, repr=False)
    detokenize: bool = field(default=True, repr=False)
    spaces_between_special_tokens: bool = field(default=True, repr=False)
    output_kind: Any = field(default=None, repr=False)
    stream_interval: int | None = field(default=None, repr=False)
    guided_decoding: Any = field(default=None, repr=False)
    logit_bias: dict[int, float] | None = field(default=None, repr=False)
    allowed_token_ids: list[int] | None = field(default=None, repr=False)
    extra_args: dict[str, Any] | None = field(default=None, repr=False)
    thinking_token_budget: int | None = field(default=None, repr=False)
    repetition_detection: Any = field(default=None, repr=False)
    # bad_words as token id sequences, set by the engine (update_from_tokenizer).
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Normalises ``stop``/``stop_token_ids``/``top_k`` and checks every field; raises
        ``ValueError`` naming the first bad one. Idempotent."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {_short(self.stop)}.")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {_short(self.stop_token_ids)}.")
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        # One tuple comparison on the hot path; the field-by-field check only when it differs.
        if (self.best_of, self.use_beam_search, self.length_penalty, self.early_stopping,
                self.logprob_token_ids, self.flat_logprobs,
                self.detokenize, self.spaces_between_special_tokens,
                self.output_kind, self.stream_interval,
                self.guided_decoding, self.extra_args, self.thinking_token_budget,
                self.repetition_detection) != _UNSUPPORTED_DEFAULTS:
            self._refuse_unsupported()
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self._validate()

    def _refuse_unsupported(self) -> None:
        for name, (what, absent) in UNSUPPORTED.items():
            value = getattr(self, name)
            if name == "best_of" and value == self.n and not isinstance(value, bool):
                continue
            if not _is_absent(value, absent):
                shown = " or ".join(repr(a) for a in absent)
                raise ValueError(f"{name} is not supported by twinserve yet ({what}); got "
                                 f"{_short(value)}. Leave it at {shown}.")

    def _validate_token_filters(self) -> None:
        """``logit_bias`` {token id: bias in [-100, 100]} (JSON's string keys become ints, as
        OpenAI's are) and ``allowed_token_ids`` (a non-empty list); the vocabulary bound is the
        engine's check."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token ids to biases, got "
                                 f"{_short(self.logit_bias)}.")
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                try:
                    token = int(key)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {_short(key)}.") from None
                _check_number(f"logit_bias[{token}]", value)
                if not -100.0 <= value <= 100.0:
                    raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value}.")
                bias[token] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or any(
                    isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids, got "
                                 f"{_short(ids)}.")
            self.allowed_token_ids = list(ids)

    def token_ids_named(self) -> list[int]:
        """Every token id the parameters name (stop, bias, allowed): the engine checks them
        against its vocabulary."""
        return [*self.stop_token_ids, *(self.logit_bias or ()), *(self.allowed_token_ids or ())]

    def _validate_extras(self) -> None:
        """``prompt_logprobs``, ``truncate_prompt_tokens``, ``bad_words``, ``logits_processors``
        and ``skip_reading_prefix_cache``; only called when one of them is set."""
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
            if self.prompt_logprobs > MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be at most {MAX_LOGPROBS}, got "
                                 f"{self.prompt_logprobs}.")
            if self.skip_reading_prefix_cache is False:
                raise ValueError("skip_reading_prefix_cache=False cannot be combined with "
                                 "prompt_logprobs: prefix-cache hits have no logits to give.")
            self.skip_reading_prefix_cache = True
        if self.skip_reading_prefix_cache is not None and not isinstance(
                self.skip_reading_prefix_cache, bool):
            raise ValueError("skip_reading_prefix_cache must be a boolean or None, got "
                             f"{_short(self.skip_reading_prefix_cache)}.")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=-1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be at least 1 (or -1 for "
                                 "max_model_len), got 0.")
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, str) or not isinstance(words, (list, tuple)) or any(
                    not isinstance(w, str) or not w.strip() for w in words):
                raise ValueError("bad_words must be a list of non-empty strings, got "
                                 f"{_short(words)}.")
            if len(words) > MAX_STOP_STRINGS:
                raise ValueError(f"bad_words may hold at most {MAX_STOP_STRINGS} strings, got "
                                 f"{len(words)}.")
            self.bad_words = list(words) or None
        if self.logits_processors is not None:
            procs = self.logits_processors
            if not isinstance(procs, (list, tuple)) or any(not callable(f) for f in procs):
                raise ValueError("logits_processors must be a list of callables "
                                 "(output_token_ids, logits) -> logits, got "
                                 f"{_short(procs)}.")
            self.logits_processors = list(procs) or None

    def update_from_tokenizer(self, encode: Callable[[str], list[int]]) -> None:
        """Tokenizes ``bad_words`` as vLLM does: each word as given (left-stripped) and with
        a leading space, the latter kept only when it tokenizes to as many tokens with another
        first token (a word-initial variant). ``encode`` adds no special tokens."""
        if not self.bad_words:
            self.bad_words_token_ids = None
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            plain = encode(word.lstrip())
            spaced = encode(" " + word.lstrip())
            for ids in (plain, spaced):
                if not ids:
                    continue
                if ids is spaced and plain and (ids[0] == plain[0] or len(ids) != len(plain)):
                    continue
                sequences.append(list(ids))
        self.bad_words_token_ids = sequences or None

    def _validate(self) -> None:
        if (self.prompt_logprobs is not None or self.truncate_prompt_tokens is not None
                or self.bad_words is not None or self.logits_processors is not None
                or self.skip_reading_prefix_cache is not None):
            self._validate_extras()
        self._validate_token_filters()
        _check_int("n", self.n, minimum=1)
        _check_number("temperature", self.temperature, minimum=0.0)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k, minimum=0)
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63))
            if self.seed >= 2**63:
                raise ValueError(f"seed must be below 2**63, got {self.seed}.")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, got {self.logprobs}.")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got "
                             f"{len(self.stop)}.")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {_short(s)} in it.")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings may be at most {MAX_STOP_STRING_CHARS} "
                                 f"characters long, got one of {len(s)}.")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {_short(value)}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _short(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (error messages echo client input)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_absent(value: object, absent: tuple[Any, ...]) -> bool:
    """``value`` is one of ``absent`` (a bool only ever equals a bool: ``0 != False`` here)."""
    return any(value is a or (type(value) is type(a) and value == a)
               or (isinstance(a, float) and type(value) is int and value == a)
               for a in absent)


def _check_int(name: str, value: object, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {_short(value)}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}.")


def _check_number(name: str, value: object, minimum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {_short(value)}.")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a number, got NaN.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be non-negative, got {value}.")
