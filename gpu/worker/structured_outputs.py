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
A matcher that reaches a dead end (an error state: llguidance then allows only EOS) is recorded;
``take_dead_ends`` hands those request ids to the engine, which reports them as finished with
``"error"`` (vLLM's ``FinishReason.ERROR``) rather than "stop" with non-conforming text.

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
from typing import Any

import llguidance
import numpy as np
import torch

from twinserve.core.request import Request
from twinserve.core.structured_outputs import StructuredOutputsParams
from twinserve.gpu.worker.schema_contract import check_depth, first_unsatisfiable, strict_schema

MATCHER_CACHE_SIZE = 128  # distinct specs kept compiled per runner
PROBE_NODES = 64  # states the search of a grammar or regex visits at most (~0.1-3 ms each)


def compile_grammar(so: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``so``; ``ValueError`` naming the field when it is invalid or
    when no finite output satisfies it. JSON schemas are closed first unless
    ``so.disable_additional_properties`` is False (``schema_contract.strict_schema``)."""
    kind = so.kind
    field = f"structured_outputs.{kind}"
    try:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                _json_schema(so), defaults={"whitespace_flexible": False})
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
    # JSON schemas were checked by ``first_unsatisfiable``; choices always end.
    if kind in ("grammar", "regex") and _no_finite_output(grammar):
        raise ValueError(f"{field} is unsatisfiable: no finite output matches it (a rule "
                         "that refers to itself with no way out, such as "
                         "`start: start \"a\"`).")
    return grammar


def _json_schema(so: StructuredOutputsParams) -> Any:
    schema = so.json if so.json is not None else {}
    if isinstance(schema, str):
        schema = json.loads(schema)  # validated by StructuredOutputsParams
    check_depth(schema)
    where = first_unsatisfiable(schema)
    if where is not None:
        raise ValueError(f"the schema at {where} is unsatisfiable: every value it allows "
                         "would be infinite or impossible (a required property that refers "
                         "back to its own schema, {\"$ref\": \"#\"}, false or an empty enum).")
    return strict_schema(schema) if so.disable_additional_properties else schema


class _ByteTokens:
    """A 256-byte vocabulary plus EOS (id 256): enough for llguidance to search a grammar's
    outputs without the model's tokenizer."""

    EOS = 256

    def __init__(self) -> None:
        self.eos_token_id = self.EOS
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.special_token_ids = [self.EOS]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _no_finite_output(grammar: str) -> bool:
    """True when a bounded search over bytes proves that no output completes the grammar:
    every path llguidance allows ends in its error state before one where EOS is allowed
    (left recursion with no base case, ``b: "c" b``). A search that runs out of its
    ``PROBE_NODES`` budget proves nothing, and the grammar is accepted."""
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))
    stack = [llguidance.LLMatcher(tokenizer, grammar, log_level=0)]
    for _ in range(PROBE_NODES):
        if not stack:
            return True
        matcher = stack.pop()
        if matcher.is_error():
            continue
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")[:257]
        if matcher.is_error():
            continue
        if bits[_ByteTokens.EOS]:
            return False
        for byte in reversed(np.flatnonzero(bits).tolist()):  # the lowest byte first
            child = matcher.deep_copy()
            child.consume_token(byte)
            stack.append(child)
    return False


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
        self._dead_ends: list[str] = []
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
        self._dead_ends.extend(requests[i].request_id for (m, _), i in zip(matchers, rows)
                               if m.is_error())
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

    def take_dead_ends(self) -> list[str]:
        """The requests whose grammar reached a dead end since the last call."""
        dead, self._dead_ends = self._dead_ends, []
        return dead

    def free(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)
