"""``/v1/embeddings``: vLLM's embed task on the loaded decoder model (the last prompt token's
final hidden state, L2-normalised), in OpenAI's request and response shape.

Each input is an engine request (``PoolingParams``): the shared scheduler admits it and
prefills it into the KV cache like any prompt (chunked, batched with generation); the step that
completes its prompt returns the pooled state and the request ends there. ``encoding_format``
``base64`` is the float32 little-endian bytes (what the ``openai`` client asks for by default).
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any, Literal, cast

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from twinserve.core.errors import EngineOverloaded
from twinserve.core.pooling_params import PoolingParams
from twinserve.core.request_output import EmbeddingRequestOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.entrypoints.openai.generation import (
    PromptInput,
    check_model,
    check_priority,
    check_prompt_count,
    tenant_of,
    unless_disconnected,
)
from twinserve.entrypoints.openai.http_errors import APIError, retry_after
from twinserve.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    RequestModel,
    now_s,
    random_id,
)
from twinserve.entrypoints.openai.server_state import ServerState
from twinserve.gpu.engine.request_surface import truncate_prompt

logger = logging.getLogger("twinserve.server")

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(RequestModel):
    """OpenAI's ``/v1/embeddings`` body plus vLLM's extras (``truncate_prompt_tokens``,
    ``add_special_tokens``, ``normalize``, ``priority``)."""

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_s)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def embedding_inputs(state: ServerState, body: EmbeddingRequest) -> list[PromptInput]:
    """``input`` as token ids: a string, a list of strings, a list of token ids or a list of
    those; each truncated (``truncate_prompt_tokens``) and checked against the context."""
    raw: Any = body.input
    if isinstance(raw, str) or (isinstance(raw, list) and raw
                                and all(isinstance(t, int) for t in raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "input must be a non-empty string, list of strings, list of token "
                            "ids, or list of those.", "input")
    check_prompt_count(state, len(raw), 1)
    vocab = state.engine.runner.vocab_size
    prompts = []
    for item in raw:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "input strings must not be empty.", "input")
            ids = state.tokenizer.encode(item, add_special_tokens=body.add_special_tokens)
        else:
            if not item or any(not 0 <= t < vocab for t in item):
                raise APIError(400, f"input token id lists must be non-empty, with ids in "
                                    f"[0, {vocab}).", "input")
            ids = list(item)
        try:
            ids = truncate_prompt(ids, body.truncate_prompt_tokens, state.max_model_len,
                                  "truncate_prompt_tokens")
        except ValueError as exc:
            raise APIError(400, str(exc), "truncate_prompt_tokens") from None
        if len(ids) >= state.max_model_len:  # the engine's prefill step samples one token
            raise APIError(400, f"This model's maximum context length is "
                                f"{state.max_model_len} tokens. However, you requested "
                                f"{len(ids)} tokens in the input for embedding generation. "
                                "Please reduce the length of the input.", "input")
        prompts.append(PromptInput(ids, item if isinstance(item, str) else None))
    return prompts


def encode_embedding(values: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return values


def check_embedding_request(state: ServerState, body: EmbeddingRequest) -> None:
    hidden = state.engine.runner.config.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        raise APIError(400, f"dimensions: this model does not support Matryoshka embeddings "
                            f"(its embeddings have {hidden} dimensions), got "
                            f"{body.dimensions}.", "dimensions")
    unknown = [name for name in body.raw if name not in type(body).model_fields]
    if unknown:
        logger.warning("embedding request: ignoring unknown field(s) %s", ", ".join(unknown))


async def create_embedding(state: ServerState, body: EmbeddingRequest,
                           request: Request) -> Response:
    lora = check_model(state, body.model)
    check_embedding_request(state, body)
    check_priority(state, body.priority)
    prompts = embedding_inputs(state, body)
    tenant = tenant_of(state, request, cast(Any, body))  # reads only body.user
    state.tenants.acquire(tenant, len(prompts))
    if lora is not None:
        state.loras.hold(lora, len(prompts))
    rid = random_id("embd")
    streams = []
    try:
        pooling = PoolingParams(normalize=body.normalize is not False)
        extra = {} if lora is None else {"lora_request": lora.request}
        for i, p in enumerate(prompts):
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            streams.append(state.async_engine.submit(
                p.token_ids, params, f"{rid}-{i}", priority=body.priority, tenant=tenant,
                pooling_params=pooling, **extra))
        await _accepted(state, request, streams)
        outputs = await unless_disconnected(
            request, asyncio.gather(*(_final(s) for s in streams)))
    finally:
        for s in streams:
            s.close()
        state.tenants.release(tenant, len(prompts))
        if lora is not None:
            state.loras.release(lora, len(prompts))
    num_tokens = sum(len(p.token_ids) for p in prompts)
    for p, s in zip(prompts, streams):
        state.metrics.observe_embeddings(len(p.token_ids), 1, s.engine_index)
    data = [EmbeddingData(index=i, embedding=encode_embedding(o.outputs.embedding,
                                                              body.encoding_format))
            for i, o in enumerate(outputs)]
    response = EmbeddingResponse(id=rid, model=lora.name if lora is not None else
                                 state.model_name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens,
                                                      total_tokens=num_tokens))
    return JSONResponse(response.model_dump())


async def _accepted(state: ServerState, request: Request, streams: list[Any]) -> None:
    """Every stream accepted, with the engine's refusals as status codes (as generation)."""
    async def all_accepted() -> None:
        for s in streams:
            await s.accepted()
    try:
        await unless_disconnected(request, all_accepted())
    except EngineOverloaded as exc:
        state.metrics.observe_rejection(exc.reason)
        raise APIError(503, f"The server is overloaded ({exc}); retry after "
                            f"{exc.retry_after_s:.0f} s.", None,
                       retry_after(exc.retry_after_s)) from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


async def _final(stream: Any) -> EmbeddingRequestOutput:
    last = None
    async for out in stream.outputs():
        last = out
    if not isinstance(last, EmbeddingRequestOutput):
        reason = getattr(last, "error", None) or "the request ended without an embedding"
        raise APIError(500, f"The embedding request failed: {reason}.")
    return last
