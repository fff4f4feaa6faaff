"""``/v1/chat/completions``: the chat-template prompt, the handler, and its response and stream
chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from twinserve.entrypoints.generation import (
    Generation,
    PromptInput,
    TokenLogprob,
    build_sampling_params,
    check_model,
    check_priority,
    check_prompt_count,
    check_request_limits,
    finite_logprob,
    refuse_unimplemented,
    resolve_max_tokens,
    sse_response,
    start_generation,
    tenant_of,
    token_decoder,
)
from twinserve.entrypoints.http_errors import APIError
from twinserve.entrypoints.protocol import (
    CHAT,
    AssistantMessage,
    ChatChoiceLogProbs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatStreamChoice,
    DeltaMessage,
    TokenizeRequest,
    random_id,
)
from twinserve.entrypoints.server_state import ServerState


# ==== /v1/chat/completions =======================================================================
def chat_prompt(state: ServerState, body: ChatCompletionRequest | TokenizeRequest) -> PromptInput:
    try:
        messages = [m.as_template_dict() for m in body.messages or []]
        text = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt)
    except APIError:
        raise
    except Exception as exc:  # template errors (jinja raise_exception, no template)
        raise APIError(400, f"Could not apply the chat template: {exc}", "messages") from exc
    # The template holds the special tokens itself: encode without adding more (unless asked).
    return PromptInput(state.tokenizer.encode(text, add_special_tokens=body.add_special_tokens),
                       text)


def chat_logprobs(state: ServerState, lps: list[TokenLogprob]) -> ChatChoiceLogProbs:
    decode = token_decoder(state)

    def entry(token_id: int, logprob: float) -> ChatLogProb:
        token = decode(token_id)
        return ChatLogProb(token=token, logprob=finite_logprob(logprob),
                           bytes=list(token.encode("utf-8")))

    content = []
    for lp in lps:
        head = entry(lp.token_id, lp.logprob)
        top = [entry(t, v) for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])]
        content.append(ChatLogProbsContent(**head.model_dump(), top_logprobs=top))
    return ChatChoiceLogProbs(content=content)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest,
                                 request: Request) -> Response:
    lora = check_model(state, body.model)
    refuse_unimplemented(body, CHAT)
    check_priority(state, body.priority)
    check_request_limits(state, body)
    check_prompt_count(state, 1, body.n)
    prompt = chat_prompt(state, body)
    field_name = "max_completion_tokens" if body.max_completion_tokens is not None \
        else "max_tokens"
    max_tokens = resolve_max_tokens(state, len(prompt.token_ids), body.requested_max_tokens,
                                    field_name, "messages")
    try:
        num_logprobs = body.num_logprobs
    except ValueError as exc:
        raise APIError(400, str(exc), "top_logprobs") from exc
    params = build_sampling_params(body, max_tokens, num_logprobs)
    gen = Generation(state, request, [prompt], [params], random_id("chatcmpl"), body.priority,
                     tenant_of(state, request, body), lora=lora)
    await start_generation(gen)
    if body.stream:
        return sse_response(state, gen, chat_chunks(state, gen, body))
    await gen.collect()
    return JSONResponse(chat_response(state, gen, body).model_dump())


def chat_response(state: ServerState, gen: Generation,
                  body: ChatCompletionRequest) -> ChatCompletionResponse:
    choices = []
    for index, choice in enumerate(gen.choices):
        comp = gen.final_completion(index)
        choices.append(ChatCompletionChoice(
            index=index, message=AssistantMessage(content=comp.text if comp else ""),
            logprobs=chat_logprobs(state, choice.logprobs) if body.logprobs else None,
            finish_reason=comp.finish_reason if comp else "abort",
            stop_reason=comp.stop_reason if comp else None))
    return ChatCompletionResponse(id=gen.id, model=gen.model_name,
                                  choices=choices, usage=gen.usage())


async def chat_chunks(state: ServerState, gen: Generation,
                      body: ChatCompletionRequest) -> AsyncIterator[BaseModel]:
    rid = gen.id
    for index in range(len(gen.choices)):  # the role first, as OpenAI does
        yield ChatCompletionChunk(id=rid, model=gen.model_name, choices=[ChatStreamChoice(
            index=index, delta=DeltaMessage(role="assistant", content=""))])
    async for index, delta in gen.deltas():
        logprobs = chat_logprobs(state, delta.logprobs) if body.logprobs else None
        yield ChatCompletionChunk(id=rid, model=gen.model_name, choices=[ChatStreamChoice(
            index=index, delta=DeltaMessage(content=delta.text), logprobs=logprobs,
            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)])
    if body.include_usage:
        yield ChatCompletionChunk(id=rid, model=gen.model_name, choices=[], usage=gen.usage())
