"""Constrained decoding with llguidance: one matcher per constrained request, masks per step.

``compile_grammar`` turns a request's ``StructuredOutputsParams`` into an llguidance grammar and
checks it (a bad schema, regex or grammar is a ``ValueError`` naming the field, raised when the
request is added). ``StructuredOutputs`` (one per model runner, nothing shared between engines)
keeps a compiled matcher per distinct spec (an LRU cache: a request gets a ``deep_copy`` of it,
microseconds) and each constrained request's matcher, which it keeps in step with the request's
output tokens: before a step's mask it consumes the tokens it has not seen (after a sampled step
that is none; after a recompute preemption the output is kept, so none either) and rebuilds it
when the output is shorter than what it consumed. Once the grammar is complete the mask allows
only the EOS token, so the request ends the way the scheduler already knows: EOS -> "stop".

Compilation off the step: ``prefetch`` (called when a request is added) compiles a spec not yet
cached on one background thread, so the step that first masks the request usually finds it
ready (llguidance compiles outside the GIL while the step's forward pass runs); if not, that
step waits for it. The scheduler does not hold a request back until its grammar is ready.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import numpy as np
import torch

from twinserve.core.request import Request
from twinserve.core.structured_outputs import StructuredOutputsParams

MATCHER_CACHE_SIZE = 128  # distinct specs kept compiled per runner


def compile_grammar(so: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``so``; ``ValueError`` naming the field when it is invalid."""
    kind = so.kind
    field = f"structured_outputs.{kind}"
    try:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                so.json if so.json is not None else {}, defaults={"whitespace_flexible": False})
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(so.regex or "")
        elif kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in so.choice or ()))
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(so.grammar or "")
    except (ValueError, TypeError) as e:
        raise ValueError(f"{field} is invalid: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{field} is invalid: {error.strip()}")
    return grammar


class _State:
    __slots__ = ("matcher", "num_consumed")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.num_consumed = 0


class StructuredOutputs:
    """Per-request llguidance matchers for one model runner."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_id: int | None) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.3 s)
        self._executor: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._pending: dict[tuple[str, str], Future[llguidance.LLMatcher]] = {}
        self._pool: ThreadPoolExecutor | None = None  # started by the first prefetch
        self._states: dict[str, _State] = {}
        self._words = (vocab_size + 31) // 32

    def __len__(self) -> int:
        return len(self._states)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if self.eos_token_id is None:
                raise ValueError("structured_outputs needs a model with an EOS token.")
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json.read_text(encoding="utf-8"), n_vocab=self.vocab_size,
                eos_token=self.eos_token_id)
            self._executor = llguidance.LLExecutor()
        return self._tokenizer

    def _compile(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        compiled = llguidance.LLMatcher(self._llg_tokenizer(), compile_grammar(so), log_level=0)
        if compiled.is_error():
            raise ValueError(f"structured_outputs.{so.kind} is invalid: "
                             f"{compiled.get_error()}")
        return compiled

    def prefetch(self, so: StructuredOutputsParams) -> None:
        """Starts compiling ``so`` in the background unless it is cached or under way."""
        key = so.key
        self._collect_done()
        if key in self._compiled or key in self._pending or \
                len(self._pending) >= MATCHER_CACHE_SIZE:
            return
        self._llg_tokenizer()  # built here, once, not on the worker
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._pending[key] = self._pool.submit(self._compile, so)

    def _collect_done(self) -> None:
        """Finished compilations into the cache (failed ones are dropped: the request's own
        mask compiles again and raises), so abandoned prefetches do not pile up."""
        for key, future in list(self._pending.items()):
            if future.done():
                del self._pending[key]
                if future.exception() is None:
                    self._remember(key, future.result())

    def _remember(self, key: tuple[str, str], compiled: llguidance.LLMatcher) -> None:
        self._compiled[key] = compiled
        if len(self._compiled) > MATCHER_CACHE_SIZE:
            self._compiled.popitem(last=False)

    def _fresh_matcher(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        key = so.key
        compiled = self._compiled.get(key)
        if compiled is None:
            pending = self._pending.pop(key, None)
            compiled = pending.result() if pending is not None else self._compile(so)
            self._remember(key, compiled)
        else:
            self._compiled.move_to_end(key)
        return compiled.deep_copy()

    def close(self) -> None:
        """Stops the compiling thread (pending compilations are dropped)."""
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _synced(self, request: Request) -> _State:
        """The request's matcher, having consumed exactly its output tokens so far."""
        state = self._states.get(request.request_id)
        output = request.output_token_ids
        if state is None or state.num_consumed > len(output):
            so = request.sampling_params.structured_outputs
            assert so is not None  # bitmask passes constrained rows only
            state = _State(self._fresh_matcher(so))
            self._states[request.request_id] = state
        if state.num_consumed < len(output):
            m = state.matcher
            for token in output[state.num_consumed:]:
                if m.is_stopped():
                    break
                m.consume_token(token)
            state.num_consumed = len(output)
        return state

    def bitmask(self, requests: list[Request]) -> tuple[list[int], torch.Tensor] | None:
        """``(rows, allowed[len(rows), vocab] bool)`` for the constrained rows of ``requests``,
        or ``None`` when no row is constrained. One llguidance call fills every row's mask."""
        rows = [i for i, r in enumerate(requests)
                if r.sampling_params.structured_outputs is not None]
        if not rows:
            return None
        matchers = [(self._synced(requests[i]).matcher, j) for j, i in enumerate(rows)]
        words = np.full((len(rows), self._words), -1, dtype=np.int32)
        assert self._executor is not None
        self._executor.unsafe_compute_mask_ptr(matchers, words.ctypes.data, self._words * 4,
                                               len(rows))
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
        return rows, torch.from_numpy(bits[:, :self.vocab_size].astype(bool))

    def advance(self, requests: list[Request], token_ids: list[int]) -> None:
        """Each constrained request's matcher consumes the token just sampled for it."""
        for request, token in zip(requests, token_ids):
            if request.sampling_params.structured_outputs is None:
                continue
            state = self._states.get(request.request_id)
            if state is None or state.num_consumed != len(request.output_token_ids):
                continue  # out of step: re-synced before the next mask
            if not state.matcher.is_stopped():
                state.matcher.consume_token(token)
            state.num_consumed += 1

    def free(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)
