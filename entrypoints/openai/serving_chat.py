"""``/v1/chat/completions``: the chat-template prompt, the handler, and its response and stream
chunks."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from twinserve.core.sampling_params import SamplingParams
from twinserve.entrypoints.chat_template import ChatTemplateOptions, encode_chat
from twinserve.entrypoints.chat_tools import ToolRequest, check_history, parse_tools, tool_request
from twinserve.entrypoints.openai.generation import (
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
from twinserve.entrypoints.openai.http_errors import APIError
from twinserve.entrypoints.openai.protocol import (
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
    FunctionCall,
    TokenizeRequest,
    ToolCall,
    random_id,
)
from twinserve.entrypoints.openai.server_state import ServerState
from twinserve.entrypoints.tool_parsers import ParsedCall, ToolParser
from twinserve.entrypoints.tool_parsers.streaming import ToolCallStreamer
from twinserve.gpu.worker.structured_outputs import compile_grammar


# ==== /v1/chat/completions =======================================================================
def _field(exc: ValueError) -> str:
    """The request field a chat ValueError's message starts with (``tools[1].function`` ->
    ``tools``)."""
    return re.split(r"[\s.\[:,]", str(exc), maxsplit=1)[0]


def chat_prompt(state: ServerState, body: ChatCompletionRequest | TokenizeRequest,
                tools: ToolRequest | None = None) -> PromptInput:
    """The conversation rendered and encoded; 400 naming the field for what cannot be."""
    opts = state.chat
    if body.chat_template is not None and not opts.trust_request_chat_template:
        raise APIError(400, "chat_template: this server does not accept chat templates in "
                            "requests (start it with --trust-request-chat-template to allow "
                            "them).", "chat_template")
    try:
        messages = [m.as_template_dict() for m in body.messages or []]
        check_history(messages)
        if tools is None:
            tools = ToolRequest(parse_tools(body.tools))
        options = ChatTemplateOptions(
            chat_template=body.chat_template or opts.chat_template,
            chat_template_kwargs=body.chat_template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, tools=tools.template_tools)
        # The template holds the special tokens itself: encode without adding more (unless
        # asked); the contents' special-token text stays text unless split_special_tokens=false.
        prompt = encode_chat(state.tokenizer, messages, options, opts.tool_format(),
                             split_special_tokens=body.split_special_tokens,
                             add_special_tokens=body.add_special_tokens)
    except APIError:
        raise
    except ValueError as exc:
        raise APIError(400, str(exc), _field(exc)) from None
    return PromptInput(prompt.token_ids, prompt.text)


def chat_tool_request(state: ServerState, body: ChatCompletionRequest) -> ToolRequest:
    try:
        tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls,
                             state.chat.auto_tools)
    except ValueError as exc:
        raise APIError(400, str(exc), _field(exc)) from None
    if tools.structured_outputs() is not None and (
            body.structured_outputs is not None or (body.response_format or {}).get(
                "type", "text") != "text"):
        raise APIError(400, f"tool_choice {body.tool_choice!r} is enforced by constrained "
                            "decoding, so response_format and structured_outputs may not be "
                            "given with it.", "tool_choice")
    return tools


def with_tool_grammar(params: SamplingParams, tools: ToolRequest) -> SamplingParams:
    so = tools.structured_outputs()
    if so is None:
        return params
    try:
        compile_grammar(so)
    except ValueError as exc:
        raise APIError(400, f"tools: the tools' parameter schemas cannot be enforced "
                            f"together: {exc}", "tools") from None
    return dataclasses.replace(params, structured_outputs=so)


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
    tools = chat_tool_request(state, body)
    prompt = chat_prompt(state, body, tools)
    field_name = "max_completion_tokens" if body.max_completion_tokens is not None \
        else "max_tokens"
    max_tokens = resolve_max_tokens(state, len(prompt.token_ids), body.requested_max_tokens,
                                    field_name, "messages")
    try:
        num_logprobs = body.num_logprobs
    except ValueError as exc:
        raise APIError(400, str(exc), "top_logprobs") from exc
    params = with_tool_grammar(build_sampling_params(body, max_tokens, num_logprobs), tools)
    gen = Generation(state, request, [prompt], [params], random_id("chatcmpl"), body.priority,
                     tenant_of(state, request, body), lora=lora,
                     kv_transfer_params=body.kv_transfer_params)
    await start_generation(gen)
    if body.stream:
        return sse_response(state, gen, chat_chunks(state, gen, body, tools))
    await gen.collect()
    return JSONResponse(chat_response(state, gen, body, tools).model_dump())


def _tool_call_id() -> str:
    return random_id("chatcmpl-tool")


def _finish_reason(finish: str | None, calls: list[ParsedCall], tools: ToolRequest) -> str | None:
    """A choice that ended in tool calls ends with ``tool_calls`` (a length cut stays), except
    under a named tool_choice, where OpenAI and vLLM answer ``stop``."""
    return "tool_calls" if calls and finish == "stop" and tools.mode != "named" else finish


def assistant_message(text: str, parser: ToolParser | None,
                      tools: ToolRequest) -> tuple[AssistantMessage, list[ParsedCall]]:
    if parser is None:
        return AssistantMessage(content=text), []
    parsed = parser.parse_final(text)
    calls = tools.kept(parsed.calls)
    if not calls:
        return AssistantMessage(content=text), []
    return AssistantMessage(content=parsed.content or None, tool_calls=[
        ToolCall(id=_tool_call_id(), function=FunctionCall(name=c.name or "",
                                                           arguments=c.arguments))
        for c in calls]), calls


def chat_response(state: ServerState, gen: Generation, body: ChatCompletionRequest,
                  tools: ToolRequest) -> ChatCompletionResponse:
    choices = []
    for index, choice in enumerate(gen.choices):
        comp = gen.final_completion(index)
        parser = tools.parser(state.chat.tool_parser)
        message, calls = assistant_message(comp.text if comp else "", parser, tools)
        choices.append(ChatCompletionChoice(
            index=index, message=message,
            logprobs=chat_logprobs(state, choice.logprobs) if body.logprobs else None,
            finish_reason=_finish_reason(comp.finish_reason, calls, tools) if comp else "abort",
            stop_reason=comp.stop_reason if comp else None))
    return ChatCompletionResponse(id=gen.id, model=gen.model_name, choices=choices,
                                  usage=gen.usage(),
                                  kv_transfer_params=gen.response_kv_transfer_params())


def _stream_delta(streamer: ToolCallStreamer | None, tools: ToolRequest, text: str,
                  finish: str | None) -> tuple[DeltaMessage, str | None]:
    """One engine delta as the chunk's delta message, and its finish reason."""
    if streamer is None:
        return DeltaMessage(content=text), finish
    if finish is None:
        out = streamer.feed(text)
        calls: list[ParsedCall] = []
    else:
        out, parsed = streamer.finish(text)
        calls = tools.kept(parsed.calls)
    deltas = [d for d in out.tool_calls if tools.parallel or d.index == 0]
    message = DeltaMessage(content=out.content or (None if deltas or calls else ""),
                           tool_calls=deltas or None)
    return message, _finish_reason(finish, calls, tools)


async def chat_chunks(state: ServerState, gen: Generation, body: ChatCompletionRequest,
                      tools: ToolRequest) -> AsyncIterator[BaseModel]:
    rid = gen.id
    streamers: list[ToolCallStreamer | None] = []
    for index in range(len(gen.choices)):  # the role first, as OpenAI does
        parser = tools.parser(state.chat.tool_parser)
        streamers.append(ToolCallStreamer(parser, _tool_call_id) if parser else None)
        yield ChatCompletionChunk(id=rid, model=gen.model_name, choices=[ChatStreamChoice(
            index=index, delta=DeltaMessage(role="assistant", content=""))])
    async for index, delta in gen.deltas():
        logprobs = chat_logprobs(state, delta.logprobs) if body.logprobs else None
        message, finish = _stream_delta(streamers[index], tools, delta.text,
                                        delta.finish_reason)
        if message.content == "" and not logprobs and finish is None:
            continue  # held back: it may begin a tool call
        yield ChatCompletionChunk(id=rid, model=gen.model_name, choices=[ChatStreamChoice(
            index=index, delta=message, logprobs=logprobs,
            finish_reason=finish, stop_reason=delta.stop_reason)])
    if body.include_usage:
        yield ChatCompletionChunk(id=rid, model=gen.model_name, choices=[], usage=gen.usage())
