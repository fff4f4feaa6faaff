"""The OpenAI-compatible HTTP server (FastAPI + uvicorn), in vLLM's shape.

    python -m twinserve.entrypoints.server --scheduling-policy fcfs --port 8000
    # or, from Python:  run_server(parser.parse_args([...]))   (see add_serve_args)

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming, ``data: [DONE]``),
``/v1/models``, ``/health``, ``/metrics`` (Prometheus, vLLM's names), ``/tokenize``,
``/detokenize``, ``/version``, ``POST /reset_prefix_cache``.

``build_app(async_engine, args)`` builds one self-contained app: its state hangs off closures and
``app.state``, its metrics live in its own registry, so two apps in one process share nothing.
Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. A client that goes
away (mid-stream or while waiting for a whole response) has its request aborted, which frees its
KV blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

import twinserve
from twinserve.core.request_output import CompletionOutput, RequestOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.entrypoints.async_engine import AsyncEngine, EngineDeadError
from twinserve.entrypoints.engine_args import add_engine_args, engine_kwargs
from twinserve.entrypoints.http_errors import (APIError, APIKeyMiddleware, BodySizeLimitMiddleware,
                                              ClientGone, error_event, error_response,
                                              install_error_handlers, value_error_param)
from twinserve.entrypoints.protocol import (
    AssistantMessage, ChatChoiceLogProbs, ChatCompletionChoice, ChatCompletionChunk,
    ChatCompletionRequest, ChatCompletionResponse, ChatLogProb, ChatLogProbsContent,
    ChatStreamChoice, CompletionChoice, CompletionLogProbs, CompletionRequest, CompletionResponse,
    DeltaMessage, DetokenizeRequest, DetokenizeResponse, ModelCard,
    ModelList, PromptTokensDetails, SamplingFields, TokenizeRequest, TokenizeResponse, UsageInfo,
    random_id)
from twinserve.entrypoints.server_metrics import ServerMetrics

logger = logging.getLogger("twinserve.server")

DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20
API_KEY_ENV_VARS = ("TWINSERVE_API_KEY", "VLLM_API_KEY")
LOGPROB_FLOOR = -9999.0  # JSON has no -inf
METRICS_SNAPSHOT_TIMEOUT_S = 30.0
T = TypeVar("T")


# ==== app state ==================================================================================
@dataclass(slots=True)
class ServerState:
    async_engine: AsyncEngine
    model_name: str
    model_root: str | None
    max_model_len: int
    metrics: ServerMetrics

    @property
    def engine(self) -> Any:
        return self.async_engine.engine

    @property
    def tokenizer(self) -> Any:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "This model has no tokenizer: send prompts as token ids.")
        return tok


def _state(request: Request) -> ServerState:
    return request.app.state.twinserve


# ==== prompts, limits, sampling ==================================================================
@dataclass(slots=True)
class PromptInput:
    token_ids: list[int]
    text: str | None


def completion_prompts(state: ServerState, prompt: Any) -> list[PromptInput]:
    """A string, a list of token ids, or a list of either -> one input per prompt."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(400, "prompt must be a non-empty string, list of token ids, or list of "
                            "those.", "prompt")
    return [_one_prompt(state, p) for p in prompt]


def _one_prompt(state: ServerState, prompt: str | list[int]) -> PromptInput:
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty.", "prompt")
        return PromptInput(state.tokenizer.encode(prompt, add_special_tokens=True), prompt)
    if not prompt:
        raise APIError(400, "prompt token id lists must not be empty.", "prompt")
    vocab = state.engine.runner.vocab_size
    for t in prompt:
        if not 0 <= t < vocab:
            raise APIError(400, f"prompt token ids must be in [0, {vocab}), got {t}.", "prompt")
    return PromptInput(list(prompt), None)


def echo_text(state: ServerState, prompt: PromptInput) -> str:
    """The prompt as text, for ``echo`` (token-id prompts are decoded)."""
    if prompt.text is not None:
        return prompt.text
    tok = state.engine.tokenizer
    return tok.decode(prompt.token_ids) if tok is not None else ""


def chat_prompt(state: ServerState, body: ChatCompletionRequest | TokenizeRequest) -> PromptInput:
    try:
        messages = [m.as_template_dict() for m in body.messages or []]
        text = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt)
    except APIError:
        raise
    except Exception as exc:  # template errors (jinja raise_exception, no template)
        raise APIError(400, f"Could not apply the chat template: {exc}", "messages") from exc
    # The template holds the special tokens itself: encode without adding more.
    return PromptInput(state.tokenizer.encode(text), text)


def resolve_max_tokens(state: ServerState, prompt_len: int, requested: int | None,
                       field_name: str, prompt_field: str) -> int:
    """Checks prompt + completion against ``max_model_len`` (vLLM's wording); None means up to
    ``max_model_len``."""
    limit = state.max_model_len
    if requested is None:
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                                f"However, your request has {prompt_len} input tokens. Please "
                                "reduce the length of the input messages.", prompt_field)
        return limit - prompt_len
    if requested >= 1 and prompt_len + requested > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                            f"you requested {prompt_len + requested} tokens ({prompt_len} in the "
                            f"messages, {requested} in the completion). Please reduce the length "
                            "of the messages or completion.", field_name)
    return requested


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model")


def check_priority(state: ServerState, priority: int) -> None:
    if priority != 0 and not state.engine.policy.uses_priority:
        raise APIError(400, f"Got priority {priority} but the "
                            f"{state.engine.policy.name!r} scheduling policy does not use "
                            "priorities (start the server with --scheduling-policy priority).",
                       "priority")


def check_request_limits(state: ServerState, body: SamplingFields) -> None:
    """What the engine would only trip over inside a step (which would stop it for everyone)."""
    max_seqs = state.engine.config.max_num_seqs
    if body.n > max_seqs:
        raise APIError(400, f"n ({body.n}) exceeds max_num_seqs ({max_seqs}).", "n")
    vocab = state.engine.runner.vocab_size
    for t in body.stop_token_ids or []:
        if not 0 <= t < vocab:
            raise APIError(400, f"stop_token_ids must be in [0, {vocab}), got {t}.",
                           "stop_token_ids")


def build_sampling_params(body: SamplingFields, max_tokens: int,
                          logprobs: int | None) -> SamplingParams:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "Stream options can only be defined when `stream=True`.",
                       "stream_options")
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as exc:
        raise APIError(400, str(exc), value_error_param(exc, set(type(body).model_fields)))


def tenant_of(request: Request, body: SamplingFields) -> str:
    """The fairness tenant: the ``X-Tenant`` header (set by a gateway) wins over ``user``."""
    return request.headers.get("x-tenant") or body.user or "default"


# ==== running requests ===========================================================================
async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work``; if the client disconnects first, cancels it and raises ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves the outputs of several requests as ``(prompt index, output)``. Closing or
    cancelling the merged stream closes every request stream (so each is aborted)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream) as s:
                async for out in s:
                    queue.put_nowait((i, out, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass(slots=True)
class ChoiceDelta:
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class ChoiceState:
    """What one choice (sample) has received so far."""

    prefix: str = ""  # echo: the prompt text, sent before the first delta
    prev_cumulative: float = 0.0
    finished: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def update(self, comp: CompletionOutput, want_logprobs: bool) -> ChoiceDelta | None:
        """The delta of ``comp``; None once the choice has finished (or nothing is new)."""
        if self.finished:
            return None
        lps = self._new_logprobs(comp) if want_logprobs else []
        text, self.prefix = self.prefix + comp.delta_text, ""
        self.finished = comp.finish_reason is not None
        if not text and not lps and not self.finished:
            return None
        return ChoiceDelta(text, lps, comp.finish_reason, comp.stop_reason)

    def _new_logprobs(self, comp: CompletionOutput) -> list[TokenLogprob]:
        delta = comp.delta_token_ids
        if not delta or comp.logprobs is None:
            return []
        start = len(comp.token_ids) - len(delta)
        tops = comp.logprobs[start:start + len(delta)]  # by index: the list grows on the engine
        cumulative = comp.cumulative_logprob or 0.0
        step_total, self.prev_cumulative = cumulative - self.prev_cumulative, cumulative
        out = []
        for j, token in enumerate(delta):
            top = tops[j] if j < len(tops) else {}
            # The engine keeps only the running sum of the sampled tokens' logprobs; one token
            # per step (the norm) makes the step's sum that token's logprob.
            lp = top.get(token, step_total if len(delta) == 1 else LOGPROB_FLOOR)
            out.append(TokenLogprob(token, _finite(lp), top))
        self.logprobs.extend(out)
        return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


class Generation:
    """One API call's requests (one per prompt, each with n samples), tracked as a unit: the
    merged output stream, per-choice deltas, usage, and the metrics at the end."""

    def __init__(self, state: ServerState, request: Request, prompts: list[PromptInput],
                 params: list[SamplingParams], request_id: str, priority: int, tenant: str,
                 echo: bool = False) -> None:
        self.id = request_id
        self.state = state
        self.request = request
        self.prompts = prompts
        self.n = params[0].n
        self.want_logprobs = params[0].logprobs is not None
        self.last: list[RequestOutput | None] = [None] * len(prompts)
        self.choices = [ChoiceState(prefix=echo_text(state, p) if echo else "")
                        for p in prompts for _ in range(self.n)]
        streams = [state.async_engine.generate(p.token_ids, sp, f"{request_id}-{i}",
                                               priority=priority, tenant=tenant)
                   for i, (p, sp) in enumerate(zip(prompts, params))]
        self._merged = merge_streams(streams)
        self._first: tuple[int, RequestOutput] | None = None
        self._closed = False

    async def start(self) -> None:
        """Waits for the first output, so that a refused request is answered with a status
        code rather than inside a stream. Raises ClientGone if the client leaves meanwhile."""
        try:
            self._first = await unless_disconnected(self.request, _first_item(self._merged))
        except BaseException:
            await self.close()
            raise

    async def deltas(self) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """``(choice index, delta)`` in arrival order, until every request finished."""
        try:
            if self._first is not None:
                for item in self._on_output(*self._first):
                    yield item
            async for prompt_idx, out in self._merged:
                for item in self._on_output(prompt_idx, out):
                    yield item
        finally:
            await self.close()

    async def collect(self) -> None:
        """Consumes every output (non-streaming), aborting if the client disconnects."""
        async def drain() -> None:
            async for _ in self.deltas():
                pass
        try:
            await unless_disconnected(self.request, drain())
        finally:
            await self.close()

    def _on_output(self, prompt_idx: int, out: RequestOutput) -> list[tuple[int, ChoiceDelta]]:
        self.last[prompt_idx] = out
        result = []
        for comp in out.outputs:
            index = prompt_idx * self.n + comp.index
            delta = self.choices[index].update(comp, self.want_logprobs)
            if delta is not None:
                result.append((index, delta))
        return result

    async def close(self) -> None:
        """Aborts what is unfinished (idempotent) and counts the requests in the metrics."""
        if self._closed:
            return
        self._closed = True
        await self._merged.aclose()
        for last in self.last:
            self.state.metrics.observe_request_end(last)

    def final_completion(self, index: int) -> CompletionOutput | None:
        out = self.last[index // self.n]
        if out is None:
            return None
        return out.outputs[index % self.n]

    def usage(self) -> UsageInfo:
        outs = [o for o in self.last if o is not None]
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def _first_item(stream: AsyncIterator[T]) -> T:
    return await stream.__anext__()


async def start_generation(gen: Generation) -> None:
    """``gen.start()`` with the engine's refusals mapped to status codes."""
    try:
        await gen.start()
    except StopAsyncIteration as exc:
        raise APIError(500, "The engine returned no output.") from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends, however it
    ends (client gone, server stopping), so the engine hears the abort at once."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def sse_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """``data: {...}`` per chunk, then ``data: [DONE]``; errors become an error event."""
    try:
        async with contextlib.aclosing(chunks) as it:
            async for chunk in it:
                yield f"data: {chunk.model_dump_json()}\n\n"
    except EngineDeadError as exc:
        yield error_event(503, f"The engine is not running: {exc}")
    except ValueError as exc:
        yield error_event(400, str(exc))
    except Exception:
        logger.exception("error while streaming")
        yield error_event(500, "Internal server error.")
    yield "data: [DONE]\n\n"


# ==== /v1/completions ============================================================================
def completion_logprobs(state: ServerState, lps: list[TokenLogprob],
                        offset: int) -> CompletionLogProbs:
    decode = _token_decoder(state)
    result = CompletionLogProbs()
    for lp in lps:
        token = decode(lp.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(lp.logprob)
        result.top_logprobs.append({decode(t): _finite(v) for t, v in lp.top.items()})
        result.text_offset.append(offset)
        offset += len(token)
    return result


def _token_decoder(state: ServerState) -> Callable[[int], str]:
    tok = state.engine.tokenizer
    if tok is None:
        return str
    return lambda token_id: tok.decode([token_id], skip_special_tokens=False)


async def create_completion(state: ServerState, body: CompletionRequest,
                            request: Request) -> Response:
    check_model(state, body.model)
    check_priority(state, body.priority)
    check_request_limits(state, body)
    prompts = completion_prompts(state, body.prompt)
    params = [build_sampling_params(
        body, resolve_max_tokens(state, len(p.token_ids), body.max_tokens, "max_tokens",
                           "prompt"),
        body.logprobs) for p in prompts]
    gen = Generation(state, request, prompts, params, random_id("cmpl"), body.priority,
                     tenant_of(request, body), echo=body.echo)
    await start_generation(gen)
    if body.stream:
        return SSEResponse(sse_events(completion_chunks(state, gen, body)))
    await gen.collect()
    return JSONResponse(completion_response(state, gen, body).model_dump())


def completion_response(state: ServerState, gen: Generation,
                        body: CompletionRequest) -> CompletionResponse:
    choices = []
    for index, choice in enumerate(gen.choices):
        comp = gen.final_completion(index)
        text = (echo_text(state, gen.prompts[index // gen.n]) if body.echo else "") + \
            (comp.text if comp else "")
        logprobs = (completion_logprobs(state, choice.logprobs, 0)
                    if body.logprobs is not None else None)
        choices.append(CompletionChoice(
            index=index, text=text, logprobs=logprobs,
            finish_reason=comp.finish_reason if comp else "abort",
            stop_reason=comp.stop_reason if comp else None))
    return CompletionResponse(id=gen.id, model=state.model_name,
                              choices=choices, usage=gen.usage())


async def completion_chunks(state: ServerState, gen: Generation,
                            body: CompletionRequest) -> AsyncIterator[BaseModel]:
    rid = gen.id
    offsets = [0] * len(gen.choices)
    async for index, delta in gen.deltas():
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(state, delta.logprobs, offsets[index])
            offsets[index] += sum(len(t) for t in logprobs.tokens)
        yield CompletionResponse(id=rid, model=state.model_name, choices=[CompletionChoice(
            index=index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason)])
    if body.include_usage:
        yield CompletionResponse(id=rid, model=state.model_name, choices=[], usage=gen.usage())


# ==== /v1/chat/completions =======================================================================
def chat_logprobs(state: ServerState, lps: list[TokenLogprob]) -> ChatChoiceLogProbs:
    decode = _token_decoder(state)

    def entry(token_id: int, logprob: float) -> ChatLogProb:
        token = decode(token_id)
        return ChatLogProb(token=token, logprob=_finite(logprob),
                           bytes=list(token.encode("utf-8")))

    content = []
    for lp in lps:
        head = entry(lp.token_id, lp.logprob)
        top = [entry(t, v) for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])]
        content.append(ChatLogProbsContent(**head.model_dump(), top_logprobs=top))
    return ChatChoiceLogProbs(content=content)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest,
                                 request: Request) -> Response:
    check_model(state, body.model)
    check_priority(state, body.priority)
    check_request_limits(state, body)
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
                     tenant_of(request, body))
    await start_generation(gen)
    if body.stream:
        return SSEResponse(sse_events(chat_chunks(state, gen, body)))
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
    return ChatCompletionResponse(id=gen.id, model=state.model_name,
                                  choices=choices, usage=gen.usage())


async def chat_chunks(state: ServerState, gen: Generation,
                      body: ChatCompletionRequest) -> AsyncIterator[BaseModel]:
    rid = gen.id
    for index in range(len(gen.choices)):  # the role first, as OpenAI does
        yield ChatCompletionChunk(id=rid, model=state.model_name, choices=[ChatStreamChoice(
            index=index, delta=DeltaMessage(role="assistant", content=""))])
    async for index, delta in gen.deltas():
        logprobs = chat_logprobs(state, delta.logprobs) if body.logprobs else None
        yield ChatCompletionChunk(id=rid, model=state.model_name, choices=[ChatStreamChoice(
            index=index, delta=DeltaMessage(content=delta.text), logprobs=logprobs,
            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)])
    if body.include_usage:
        yield ChatCompletionChunk(id=rid, model=state.model_name, choices=[], usage=gen.usage())


# ==== the small endpoints ========================================================================
def tokenize(state: ServerState, body: TokenizeRequest) -> TokenizeResponse:
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "Give exactly one of prompt or messages.", "prompt")
    if body.messages is not None:
        tokens = chat_prompt(state, body).token_ids
    else:
        tokens = state.tokenizer.encode(body.prompt or "",
                                        add_special_tokens=body.add_special_tokens)
    return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens)


def detokenize(state: ServerState, body: DetokenizeRequest) -> DetokenizeResponse:
    check_model(state, body.model)
    vocab = state.engine.runner.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens must be in [0, {vocab}), got {bad[0]}.", "tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))


async def render_metrics(state: ServerState) -> Response:
    metrics = state.metrics
    if state.async_engine.is_alive:
        try:
            stats, records = await asyncio.wait_for(state.async_engine.call(
                lambda e: (e.scheduler.stats(), e.metrics.take_requests())),
                timeout=METRICS_SNAPSHOT_TIMEOUT_S)
            metrics.take_engine_snapshot(stats, records)
        except (EngineDeadError, asyncio.TimeoutError):
            pass  # the last snapshot stands
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def model_list(state: ServerState) -> ModelList:
    return ModelList(data=[ModelCard(id=state.model_name, root=state.model_root,
                                     max_model_len=state.max_model_len)])


# ==== the app ====================================================================================
def build_app(async_engine: AsyncEngine, args: argparse.Namespace) -> FastAPI:
    """One self-contained app over a running ``AsyncEngine``. ``args`` as from
    ``add_serve_args`` (missing attributes take their defaults)."""
    engine = async_engine.engine
    model_root = str(getattr(engine.runner, "model_dir", "") or "") or None
    state = ServerState(async_engine=async_engine,
                        model_name=served_model_name(args, model_root),
                        model_root=model_root, max_model_len=int(engine.runner.max_model_len),
                        metrics=ServerMetrics(served_model_name(args, model_root)))
    app = FastAPI(title="twinserve", version=twinserve.__version__, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.twinserve = state
    install_error_handlers(app)
    add_routes(app)
    app.add_middleware(BodySizeLimitMiddleware,
                       max_bytes=int(getattr(args, "max_request_body_bytes", None)
                                     or DEFAULT_MAX_REQUEST_BODY_BYTES))
    api_key = resolve_api_key(args)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def add_routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _guard(create_completion(_state(request), body, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _guard(create_chat_completion(_state(request), body, request))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return JSONResponse(model_list(_state(request)).model_dump())

    @app.get("/health")
    async def health(request: Request) -> Response:
        if _state(request).async_engine.is_alive:
            return Response(status_code=200)
        return error_response(503, "The engine thread is not running.")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return await render_metrics(_state(request))

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest, request: Request) -> Response:
        return JSONResponse(tokenize(_state(request), body).model_dump())

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest, request: Request) -> Response:
        return JSONResponse(detokenize(_state(request), body).model_dump())

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": twinserve.__version__})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        done = await _state(request).async_engine.call(
            lambda e: e.scheduler.kv.reset_prefix_cache())
        return JSONResponse({"reset": bool(done)})


async def _guard(work: Awaitable[Response]) -> Response:
    """A client that left gets no answer (499 goes nowhere); the request was aborted."""
    try:
        return await work
    except ClientGone:
        return Response(status_code=499)


# ==== configuration and startup ==================================================================
def served_model_name(args: argparse.Namespace, model_root: str | None) -> str:
    name = getattr(args, "served_model_name", None)
    if name:
        return name
    model = getattr(args, "model", None)
    if model:
        return str(model)
    from twinserve.gpu.default_model import MODEL_NAME
    return MODEL_NAME


def resolve_api_key(args: argparse.Namespace) -> str | None:
    key = getattr(args, "api_key", None)
    if key:
        return key
    for var in API_KEY_ENV_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ``twinserve serve``'s flags to ``parser``: ``--model``, the real engine's knobs
    (``engine_args.add_engine_args``, vLLM's names, shared with the other subcommands) and the
    server's own."""
    parser.add_argument("--model", default=None,
                        help="HF model directory (default: the bundled SmolLM2-135M-Instruct)")
    add_engine_args(parser, simulated=False)
    server = parser.add_argument_group("server")
    server.add_argument("--served-model-name", default=None,
                        help="the model id clients send (default: --model as given)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", default=None,
                        help="require Authorization: Bearer KEY (default: $TWINSERVE_API_KEY, "
                             "then $VLLM_API_KEY)")
    server.add_argument("--max-request-body-bytes", type=int,
                        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get 413 (default 1 MiB)")
    server.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser


def engine_args_from(args: argparse.Namespace) -> Any:
    """``EngineArgs`` from the parsed flags; unset flags keep EngineArgs' defaults."""
    from twinserve.gpu.llm_engine import EngineArgs
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**engine_kwargs(args, fields))


def build_async_engine(args: argparse.Namespace) -> AsyncEngine:
    from twinserve.gpu.llm_engine import LLMEngine
    engine = LLMEngine(engine_args_from(args))
    engine.metrics.record_steps = False  # a server runs for days: keep no per-step rows
    return AsyncEngine(engine)


def run_server(args: argparse.Namespace) -> None:
    """Builds the engine from ``args``, serves until SIGINT/SIGTERM, then stops the engine."""
    import uvicorn
    async_engine = build_async_engine(args)
    try:
        app = build_app(async_engine, args)
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level=getattr(args, "uvicorn_log_level", "warning"),
                                timeout_graceful_shutdown=5)
        logger.warning("twinserve: serving %s on http://%s:%d",
                       served_model_name(args, None), args.host, args.port)
        uvicorn.Server(config).run()
    finally:
        async_engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="twinserve serve",
                                     description="OpenAI-compatible server")
    add_serve_args(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    run_server(parser.parse_args(argv))


if __name__ == "__main__":
    main()
