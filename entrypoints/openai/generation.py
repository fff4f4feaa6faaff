"""The request-to-engine machinery the endpoints share: prompt inputs, limits and validation,
sampling params, the ``Generation`` (one API call's engine requests, merged and tracked, aborted
when the client leaves) and server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from twinserve.core.errors import EngineOverloaded
from twinserve.core.logprobs import Logprob
from twinserve.core.request_output import CompletionOutput, RequestOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.entrypoints.openai.async_engine import EngineDeadError, RequestStream
from twinserve.entrypoints.openai.http_errors import (
    APIError,
    ClientGone,
    error_event,
    retry_after,
    value_error_param,
)
from twinserve.entrypoints.openai.protocol import (
    PromptTokensDetails,
    RequestModel,
    SamplingFields,
    UsageInfo,
    find_unimplemented,
)
from twinserve.entrypoints.openai.server_state import MAX_TENANT_NAME_CHARS, ServerState
from twinserve.entrypoints.openai.serving_models import ServedLoRA, resolve_model

logger = logging.getLogger("twinserve.server")

LOGPROB_FLOOR = -9999.0  # JSON has no -inf
T = TypeVar("T")


# ==== prompts, limits, sampling ==================================================================
@dataclass(slots=True)
class PromptInput:
    token_ids: list[int]
    text: str | None


def echo_text(state: ServerState, prompt: PromptInput) -> str:
    """The prompt as text, for ``echo`` (token-id prompts are decoded)."""
    if prompt.text is not None:
        return prompt.text
    tok = state.engine.tokenizer
    return tok.decode(prompt.token_ids) if tok is not None else ""


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


def check_model(state: ServerState, model: str | None) -> ServedLoRA | None:
    """The LoRA adapter ``model`` names (None: the base model); 404 for an unknown name."""
    return resolve_model(state, model)


def refuse_unimplemented(body: RequestModel, endpoint: str) -> None:
    """400 naming the first field twinserve does not implement (``protocol.UNIMPLEMENTED``);
    fields neither OpenAI nor vLLM knows are logged once per request and ignored."""
    refusal, unknown = find_unimplemented(body, endpoint)
    if refusal is not None:
        raise APIError(400, refusal.message, refusal.param)
    if unknown:
        logger.warning("%s request: ignoring unknown field(s) %s", endpoint, ", ".join(unknown))


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


def check_prompt_count(state: ServerState, num_prompts: int, n: int) -> None:
    """One API call may queue at most ``--max-prompts-per-request`` sequences (prompts x n)."""
    cap = state.limits.max_prompts_per_request
    if num_prompts * n > cap:
        raise APIError(400, f"This request asks for {num_prompts} prompt(s) x n={n} = "
                            f"{num_prompts * n} sequences; the limit is {cap} per request "
                            "(--max-prompts-per-request).", "prompt" if num_prompts > 1 else "n")


def build_sampling_params(body: SamplingFields, max_tokens: int,
                          logprobs: int | None) -> SamplingParams:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "Stream options can only be defined when `stream=True`.",
                       "stream_options")
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as exc:
        raise APIError(400, str(exc),
                       value_error_param(exc, set(type(body).model_fields))) from None


def tenant_of(state: ServerState, request: Request, body: SamplingFields) -> str:
    """The fairness tenant: with ``--tenant-from-api-key`` the name of the request's API key;
    else the ``X-Tenant`` header (set by a trusted gateway, honoured only with
    ``--trust-tenant-header``) wins over ``user``; neither: ``default``."""
    if state.limits.tenant_from_api_key:
        return str(request.state.api_key_name)
    header = request.headers.get("x-tenant") if state.limits.trust_tenant_header else None
    tenant = header or body.user or "default"
    if len(tenant) > MAX_TENANT_NAME_CHARS:
        raise APIError(400, f"The tenant name (user or X-Tenant) may be at most "
                            f"{MAX_TENANT_NAME_CHARS} characters, got {len(tenant)}.", "user")
    return tenant


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
    finished: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def update(self, comp: CompletionOutput, num_logprobs: int | None) -> ChoiceDelta | None:
        """The delta of ``comp``; None once the choice has finished (or nothing is new).
        ``num_logprobs``: the request's top-k (None: no logprobs)."""
        if self.finished:
            return None
        lps = self._new_logprobs(comp, num_logprobs) if num_logprobs is not None else []
        text, self.prefix = self.prefix + comp.delta_text, ""
        self.finished = comp.finish_reason is not None
        if not text and not lps and not self.finished:
            return None
        return ChoiceDelta(text, lps, comp.finish_reason, comp.stop_reason)

    def _new_logprobs(self, comp: CompletionOutput, k: int) -> list[TokenLogprob]:
        delta = comp.delta_token_ids
        if not delta or comp.logprobs is None:
            return []
        start = len(comp.token_ids) - len(delta)
        entries = comp.logprobs[start:start + len(delta)]  # by index: the list grows
        out = []
        for j, token in enumerate(delta):
            entry = entries[j] if j < len(entries) else {}
            sampled = entry.get(token)  # always there: Logprob dicts hold the sampled token
            lp = sampled.logprob if sampled is not None else LOGPROB_FLOOR
            out.append(TokenLogprob(token, finite_logprob(lp), top_k_logprobs(entry, k)))
        self.logprobs.extend(out)
        return out


def top_k_logprobs(entry: dict[int, Logprob] | None, k: int) -> dict[int, float]:
    """The top-k of a ``{token_id: Logprob}`` entry (the sampled token is there too, after
    them, when it is not one of them: OpenAI's ``top_logprobs`` holds the k alone)."""
    if not entry:
        return {}
    return {t: v.logprob for t, v in entry.items() if v.rank is not None and v.rank <= k}


def finite_logprob(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def token_decoder(state: ServerState) -> Callable[[int], str]:
    tok = state.engine.tokenizer
    if tok is None:
        return str
    return lambda token_id: tok.decode([token_id], skip_special_tokens=False)


class Generation:
    """One API call's requests (one per prompt, each with n samples), tracked as a unit: the
    merged output stream, per-choice deltas, usage, and the metrics at the end.

    ``start()`` submits them and returns once the engine accepted every one (so a refusal is a
    status code, and a stream's headers go out before the first token); ``close()`` (always
    reached: ``collect``, the end of ``deltas``, or the response's end) aborts what is
    unfinished and releases the tenant's slots and its hold on its LoRA adapter (``lora``:
    None for the base model)."""

    def __init__(self, state: ServerState, request: Request, prompts: list[PromptInput],
                 params: list[SamplingParams], request_id: str, priority: int, tenant: str,
                 echo: bool = False, lora: ServedLoRA | None = None,
                 kv_transfer_params: dict[str, Any] | None = None) -> None:
        if kv_transfer_params is not None and len(prompts) * params[0].n > 1:
            raise APIError(400, "kv_transfer_params takes one prompt and n=1.",
                           "kv_transfer_params")
        self.kv_transfer_params = kv_transfer_params
        self.id = request_id
        self.state = state
        self.request = request
        self.prompts = prompts
        self.params = params
        self.priority = priority
        self.tenant = tenant
        self.lora = lora
        self.model_name = state.model_name if lora is None else lora.name
        self.n = params[0].n
        self.num_logprobs = params[0].logprobs
        self.last: list[RequestOutput | None] = [None] * len(prompts)
        self.choices = [ChoiceState(prefix=echo_text(state, p) if echo else "")
                        for p in prompts for _ in range(self.n)]
        self._streams: list[RequestStream] = []
        self._merged: AsyncIterator[tuple[int, RequestOutput]] | None = None
        self._holds_tenant = False
        self._holds_lora = False
        self._closed = False

    @property
    def num_seqs(self) -> int:
        return len(self.prompts) * self.n

    async def start(self) -> None:
        """Submits every prompt and waits until the engine accepted them all. Raises what the
        engine refused one with (the others are aborted), or ClientGone if the client leaves."""
        self.state.tenants.acquire(self.tenant, len(self.prompts))
        self._holds_tenant = True
        try:
            if self.lora is not None:
                self.state.loras.hold(self.lora, self.num_seqs)
                self._holds_lora = True
            engine = self.state.async_engine
            extra: dict[str, Any] = {} if self.lora is None else {"lora_request": self.lora.request}
            if self.kv_transfer_params is not None:
                extra["kv_transfer_params"] = self.kv_transfer_params
            for i, (p, sp) in enumerate(zip(self.prompts, self.params)):
                self._streams.append(engine.submit(p.token_ids, sp, f"{self.id}-{i}",
                                                   priority=self.priority, tenant=self.tenant,
                                                   **extra))
            await unless_disconnected(self.request, _all_accepted(self._streams))
            self._merged = merge_streams([s.outputs() for s in self._streams])
        except BaseException:
            await self.close()
            raise

    async def deltas(self) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """``(choice index, delta)`` in arrival order, until every request finished."""
        try:
            if self._merged is None:
                return
            async for prompt_idx, out in self._merged:
                for item in self._on_output(prompt_idx, out):
                    if item[1].finish_reason == "error":
                        raise APIError(400, DEAD_END_MESSAGE)
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
            delta = self.choices[index].update(comp, self.num_logprobs)
            if delta is not None:
                result.append((index, delta))
        return result

    async def close(self) -> None:
        """Aborts what is unfinished (idempotent), counts the accepted requests in the metrics
        and releases the tenant's slots."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._merged is not None:
                await self._merged.aclose()  # type: ignore[attr-defined]
            for stream in self._streams:
                stream.close()
            if self._merged is not None:  # accepted: each request counts, waiting or not
                for last, stream in zip(self.last, self._streams):
                    self.state.metrics.observe_request_end(last, self.n, stream.engine_index)
        finally:
            if self._holds_tenant:
                self._holds_tenant = False
                self.state.tenants.release(self.tenant, len(self.prompts))
            if self._holds_lora and self.lora is not None:
                self._holds_lora = False
                self.state.loras.release(self.lora, self.num_seqs)

    def final_completion(self, index: int) -> CompletionOutput | None:
        out = self.last[index // self.n]
        if out is None:
            return None
        return out.outputs[index % self.n]

    def response_kv_transfer_params(self) -> dict[str, Any] | None:
        """The producer's params of a ``do_remote_decode`` request (its one prompt's output)."""
        last = self.last[0] if len(self.last) == 1 else None
        return None if last is None else getattr(last, "kv_transfer_params", None)

    def usage(self) -> UsageInfo:
        outs = [o for o in self.last if o is not None]
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def _all_accepted(streams: list[RequestStream]) -> None:
    for stream in streams:  # the engine takes adds in order: one wait covers most of them
        await stream.accepted()


async def start_generation(gen: Generation) -> None:
    """``gen.start()`` with the engine's refusals mapped to status codes: 400 for a request that
    can never run (an adapter that cannot be loaded included), 503 (``Retry-After``) when the
    engine's waiting queue (or host memory for adapters) is full, 429 for a tenant's limit."""
    public = gen.lora.public if gen.lora is not None else str
    try:
        await gen.start()
    except EngineOverloaded as exc:
        gen.state.metrics.observe_rejection(exc.reason)
        raise APIError(503, f"The server is overloaded ({public(str(exc))}); retry after "
                            f"{exc.retry_after_s:.0f} s.", None,
                       retry_after(exc.retry_after_s)) from exc
    except APIError as exc:
        if exc.status == 429:
            gen.state.metrics.observe_rejection(
                "max_tenants" if "--max-tenants" in exc.message else "max_requests_per_tenant")
        raise
    except ValueError as exc:
        raise APIError(400, public(str(exc))) from exc


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator (and ``gen``) is always closed when the response ends,
    however it ends (client gone before or after the headers, server stopping), so the engine
    hears the abort at once."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], gen: Generation) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        self._gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            await self._gen.close()


KEEPALIVE_EVENT = ": keep-alive\n\n"


async def with_keepalive(items: AsyncIterator[str], every_s: float) -> AsyncIterator[str]:
    """``items``, with an SSE comment (``: keep-alive``) whenever none came for ``every_s``
    seconds (a queued request's stream would otherwise stay silent until its first token)."""
    it = aiter(items)
    pending: asyncio.Future[str] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield KEEPALIVE_EVENT
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


def sse_response(state: ServerState, gen: Generation,
                 chunks: AsyncIterator[BaseModel]) -> SSEResponse:
    return SSEResponse(with_keepalive(sse_events(chunks), state.limits.sse_keepalive_s), gen)


DEAD_END_MESSAGE = (
    "The constrained output reached a dead end: its grammar allows no further token after the "
    "text generated so far, which therefore does not conform (finish_reason \"error\"). "
    "Give a grammar or schema in which every prefix it allows can be completed.")


async def sse_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """``data: {...}`` per chunk, then ``data: [DONE]``; errors become an error event."""
    try:
        async with contextlib.aclosing(chunks) as it:
            async for chunk in it:
                yield f"data: {chunk.model_dump_json()}\n\n"
    except EngineDeadError as exc:
        yield error_event(503, f"The engine is not running: {exc}")
    except APIError as exc:
        yield error_event(exc.status, exc.message, exc.param)
    except ValueError as exc:
        yield error_event(400, str(exc))
    except Exception:
        logger.exception("error while streaming")
        yield error_event(500, "Internal server error.")
    yield "data: [DONE]\n\n"

