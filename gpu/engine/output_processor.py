"""Turns the scheduler's per-step token outputs into ``RequestOutput``s: detokenization, stop
strings, logprobs, and the n > 1 samples of one request gathered under its id."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from twinserve.core.logprobs import PromptLogprobs
from twinserve.core.outputs import EngineCoreOutput
from twinserve.core.request import Request
from twinserve.core.request_output import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from twinserve.core.scheduler import child_request_id
from twinserve.gpu.engine.detokenizer import IncrementalDetokenizer, StopAutomaton
from twinserve.gpu.engine.tokenizer import Tokenizer
from twinserve.gpu.worker.structured_outputs import compile_grammar


@dataclass(slots=True)
class RequestState:
    request: Request
    prompt: str | None
    prompt_token_ids: list[int]  # the request's, as the list every output carries
    completions: list[CompletionOutput]
    detokenizers: list[IncrementalDetokenizer | None]
    decode: Callable[[int], str] | None = None  # a token as text, for Logprob.decoded_token
    prompt_logprobs: PromptLogprobs | None = None
    pooled: list[float] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, request: Request, prompt: str | None, detokenize: bool = True) -> None:
        params = request.sampling_params
        if params.stop and (self.tokenizer is None or not detokenize):
            raise ValueError("stop strings need a tokenizer and detokenize=True.")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer.json.")
            if request.eos_token_id is None:  # a complete grammar ends the request with EOS
                raise ValueError("structured_outputs needs a model with an EOS token.")
            compile_grammar(params.structured_outputs)  # a bad spec: ValueError naming it

        tokenizer = self.tokenizer
        ids = request.prompt_token_ids
        prompt_ids = ids if isinstance(ids, list) else list(ids)  # a replay's LazyPrompt, made once
        # One stop-string automaton per request, shared by its n samples (each keeps its state).
        stops = StopAutomaton(params.stop) if params.stop else None

        def detok() -> IncrementalDetokenizer | None:
            if tokenizer is None or not detokenize:
                return None
            return IncrementalDetokenizer(
                tokenizer, prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                include_stop_str_in_output=params.include_stop_str_in_output,
                stop_automaton=stops)

        decode = None
        if tokenizer is not None and detokenize:
            def decode(token_id: int) -> str:
                return tokenizer.decode([token_id], skip_special_tokens=False)
        self.states[request.request_id] = RequestState(
            request, prompt, prompt_ids, [CompletionOutput(i) for i in range(params.n)],
            [detok() for _ in range(params.n)], decode)

    def process(self, outputs: list[EngineCoreOutput], dead_ends: Collection[str] = (),
                ) -> tuple[list[RequestOutput | EmbeddingRequestOutput], list[str]]:
        """Returns the updated requests and the sample ids a stop string ended (the engine
        finishes those in the scheduler). ``dead_ends``: sample ids whose grammar reached a
        dead end this step; when they finish, their finish reason is ``"error"``."""
        touched: dict[str, RequestState] = {}
        stopped: list[str] = []
        for o in outputs:
            parent_id, _, index = o.request_id.rpartition("#")
            state = self.states.get(o.request_id) or self.states.get(parent_id)
            if state is None:
                continue
            idx = int(index) if state.request.request_id != o.request_id else 0
            if self._apply(state, idx, o):
                stopped.append(o.request_id)
            if o.request_id in dead_ends:
                self._dead_end(state.completions[idx], o.request_id, stopped)
            touched[state.request.request_id] = state
        results = []
        for rid, state in touched.items():
            results.append(self._snapshot(state))
            if state.finished:
                del self.states[rid]
        return results, stopped

    def _apply(self, state: RequestState, idx: int, o: EngineCoreOutput) -> bool:
        """Applies one sample's new tokens; True when a stop string ended it here."""
        comp = state.completions[idx]
        if comp.finished:
            return False
        comp.token_ids.extend(o.new_token_ids)
        comp.delta_token_ids.extend(o.new_token_ids)
        if o.new_logprobs:
            comp.logprobs = comp.logprobs or []
            for entry in o.new_logprobs:
                comp.logprobs.append(entry.as_dict(state.decode))
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + entry.logprob
        if o.prompt_logprobs is not None:
            state.prompt_logprobs = [None, *(e.as_dict(state.decode) for e in o.prompt_logprobs)]
        if o.pooled is not None:
            state.pooled = o.pooled
        if o.kv_transfer_params is not None:
            state.kv_transfer_params = o.kv_transfer_params
        if o.error is not None:
            state.error = o.error
        detok = state.detokenizers[idx]
        hit = detok.add_tokens(o.new_token_ids) if detok is not None else None
        if hit is not None and not o.finished:
            comp.finish_reason, comp.stop_reason = "stop", hit
            return True
        if o.finished:
            comp.finish_reason = "stop" if hit is not None else o.finish_reason
            comp.stop_reason = hit if hit is not None else o.stop_reason
        return False

    @staticmethod
    def _dead_end(comp: CompletionOutput, sample_id: str, stopped: list[str]) -> None:
        """The sample ends with ``"error"`` (its grammar allows nothing more but EOS, and the
        output does not conform)."""
        if not comp.finished and sample_id not in stopped:
            stopped.append(sample_id)
        comp.finish_reason, comp.stop_reason = "error", None

    def _snapshot(self, state: RequestState) -> RequestOutput | EmbeddingRequestOutput:
        req = state.request
        if req.pooling_params is not None and state.finished and state.pooled is not None:
            return EmbeddingRequestOutput(
                req.request_id, EmbeddingOutput(state.pooled or []), state.prompt_token_ids,
                True, req.num_cached_tokens or 0, state.prompt)
        outs = []
        for comp, detok in zip(state.completions, state.detokenizers):
            if detok is not None:
                delta = detok.get_delta(finished=comp.finished)
                comp.text += delta
                comp.delta_text = delta
            outs.append(CompletionOutput(comp.index, comp.text, list(comp.token_ids),
                                         comp.cumulative_logprob, comp.logprobs,
                                         comp.finish_reason, comp.stop_reason, comp.delta_text,
                                         comp.delta_token_ids))
            comp.delta_text, comp.delta_token_ids = "", []
        return RequestOutput(req.request_id, state.prompt, state.prompt_token_ids, outs,
                             state.finished, req.num_cached_tokens or 0, state.error,
                             state.prompt_logprobs, state.kv_transfer_params)

    def abort(self, request_id: str,
              reason: str = "abort") -> RequestOutput | EmbeddingRequestOutput | None:
        """Ends every sample of a request (client gone, engine stopping)."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        for comp in state.completions:
            if not comp.finished:
                comp.finish_reason = reason
        return self._snapshot(state)

    def sample_ids(self, request_id: str) -> list[str]:
        state = self.states.get(request_id)
        if state is None:
            return []
        return [child_request_id(request_id, i) for i in range(len(state.completions))]
