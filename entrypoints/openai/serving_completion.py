"""``/v1/completions``: prompts (text, token ids, or lists of those), the handler, and its
response and stream chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from twinserve.core.logprobs import PromptLogprobs
from twinserve.entrypoints.openai.generation import (
    LOGPROB_FLOOR,
    Generation,
    PromptInput,
    TokenLogprob,
    build_sampling_params,
    check_model,
    check_priority,
    check_prompt_count,
    check_request_limits,
    echo_text,
    finite_logprob,
    refuse_unimplemented,
    resolve_max_tokens,
    sse_response,
    start_generation,
    tenant_of,
    token_decoder,
    top_k_logprobs,
)
from twinserve.entrypoints.openai.http_errors import APIError
from twinserve.entrypoints.openai.protocol import (
    COMPLETION,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from twinserve.entrypoints.openai.server_state import ServerState
from twinserve.gpu.engine.request_surface import truncate_prompt


# ==== /v1/completions ============================================================================
def completion_prompts(state: ServerState, prompt: Any, add_special_tokens: bool = True,
                       n: int = 1) -> list[PromptInput]:
    """A string, a list of token ids, or a list of either -> one input per prompt (at most
    ``--max-prompts-per-request`` prompts x ``n``, checked before any is tokenized)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(400, "prompt must be a non-empty string, list of token ids, or list of "
                            "those.", "prompt")
    check_prompt_count(state, len(prompt), n)
    return [_one_prompt(state, p, add_special_tokens) for p in prompt]


def _one_prompt(state: ServerState, prompt: str | list[int],
                add_special_tokens: bool) -> PromptInput:
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty.", "prompt")
        return PromptInput(state.tokenizer.encode(prompt, add_special_tokens=add_special_tokens),
                           prompt)
    if not prompt:
        raise APIError(400, "prompt token id lists must not be empty.", "prompt")
    vocab = state.engine.runner.vocab_size
    for t in prompt:
        if not 0 <= t < vocab:
            raise APIError(400, f"prompt token ids must be in [0, {vocab}), got {t}.", "prompt")
    return PromptInput(list(prompt), None)


def truncate_prompts(state: ServerState, prompts: list[PromptInput],
                     keep: int | None) -> list[PromptInput]:
    """``truncate_prompt_tokens``: each prompt's last ``keep`` tokens (before the length check,
    so a long prompt that fits once truncated is served)."""
    if keep is None:
        return prompts
    try:
        return [PromptInput(truncate_prompt(p.token_ids, keep, state.max_model_len,
                                            "truncate_prompt_tokens"), p.text)
                for p in prompts]
    except ValueError as exc:
        raise APIError(400, str(exc), "truncate_prompt_tokens") from None


def prompt_logprob_entries(state: ServerState, prompt_ids: list[int],
                           prompt_logprobs: PromptLogprobs | None,
                           k: int) -> list[TokenLogprob | int]:
    """Echo's part of ``logprobs``: one entry per prompt token (the first, which nothing
    predicts, as its bare token id), each with the prompt token's logprob and the top-k."""
    if prompt_logprobs is None:
        return []
    entries: list[TokenLogprob | int] = []
    for token, entry in zip(prompt_ids, prompt_logprobs):
        if entry is None:
            entries.append(token)
            continue
        chosen = entry.get(token)
        lp = chosen.logprob if chosen is not None else LOGPROB_FLOOR
        entries.append(TokenLogprob(token, finite_logprob(lp), top_k_logprobs(entry, k)))
    return entries


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None,
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` field: {token id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": finite_logprob(v.logprob), "rank": v.rank,
                      "decoded_token": v.decoded_token} for t, v in entry.items()}
            for entry in prompt_logprobs]


def completion_logprobs(state: ServerState, lps: list[TokenLogprob | int],
                        offset: int) -> CompletionLogProbs:
    """OpenAI's ``logprobs``; a bare token id (echo's first prompt token) has none (null)."""
    decode = token_decoder(state)
    result = CompletionLogProbs()
    for lp in lps:
        if isinstance(lp, int):
            token = decode(lp)
            result.tokens.append(token)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(offset)
            offset += len(token)
            continue
        token = decode(lp.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for t, v in lp.top.items():  # in rank order: tokens that decode alike keep the best
            top.setdefault(decode(t), finite_logprob(v))
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(token)
    return result


async def create_completion(state: ServerState, body: CompletionRequest,
                            request: Request) -> Response:
    lora = check_model(state, body.model)
    refuse_unimplemented(body, COMPLETION)
    check_priority(state, body.priority)
    check_request_limits(state, body)
    prompts = truncate_prompts(
        state, completion_prompts(state, body.prompt, body.add_special_tokens, body.n),
        body.truncate_prompt_tokens)
    params = [build_sampling_params(
        body, resolve_max_tokens(state, len(p.token_ids), body.max_tokens, "max_tokens",
                           "prompt"),
        body.logprobs) for p in prompts]
    gen = Generation(state, request, prompts, params, random_id("cmpl"), body.priority,
                     tenant_of(state, request, body), echo=body.echo, lora=lora,
                     kv_transfer_params=body.kv_transfer_params)
    await start_generation(gen)
    if body.stream:
        return sse_response(state, gen, completion_chunks(state, gen, body))
    await gen.collect()
    return JSONResponse(completion_response(state, gen, body).model_dump())


def completion_response(state: ServerState, gen: Generation,
                        body: CompletionRequest) -> CompletionResponse:
    choices = []
    for index, choice in enumerate(gen.choices):
        comp = gen.final_completion(index)
        text = (echo_text(state, gen.prompts[index // gen.n]) if body.echo else "") + \
            (comp.text if comp else "")
        last = gen.last[index // gen.n]
        prompt_lps = last.prompt_logprobs if last is not None else None
        logprobs = None
        if body.logprobs is not None:
            echoed = (prompt_logprob_entries(state, gen.prompts[index // gen.n].token_ids,
                                             prompt_lps, body.logprobs) if body.echo else [])
            logprobs = completion_logprobs(state, [*echoed, *choice.logprobs], 0)
        choices.append(CompletionChoice(
            index=index, text=text, logprobs=logprobs,
            finish_reason=comp.finish_reason if comp else "abort",
            stop_reason=comp.stop_reason if comp else None,
            prompt_logprobs=(prompt_logprobs_json(prompt_lps)
                             if body.prompt_logprobs is not None else None)))
    return CompletionResponse(id=gen.id, model=gen.model_name, choices=choices,
                              usage=gen.usage(),
                              kv_transfer_params=gen.response_kv_transfer_params())


async def completion_chunks(state: ServerState, gen: Generation,
                            body: CompletionRequest) -> AsyncIterator[BaseModel]:
    rid = gen.id
    offsets = [0] * len(gen.choices)
    echo_pending = [body.echo and body.logprobs is not None] * len(gen.choices)
    async for index, delta in gen.deltas():
        logprobs = None
        if body.logprobs is not None:
            lps: list[TokenLogprob | int] = list(delta.logprobs)
            last = gen.last[index // gen.n]
            if echo_pending[index] and last is not None and last.prompt_logprobs is not None:
                echo_pending[index] = False  # the prompt's logprobs go with its text
                lps[:0] = prompt_logprob_entries(state, gen.prompts[index // gen.n].token_ids,
                                                 last.prompt_logprobs, body.logprobs)
            logprobs = completion_logprobs(state, lps, offsets[index])
            offsets[index] += sum(len(t) for t in logprobs.tokens)
        yield CompletionResponse(id=rid, model=gen.model_name, choices=[CompletionChoice(
            index=index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason)])
    if body.include_usage:
        yield CompletionResponse(id=rid, model=gen.model_name, choices=[], usage=gen.usage())
