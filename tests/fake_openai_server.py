"""A tiny OpenAI-compatible streaming server for the ``bench serve`` tests.

``make_app(FakeConfig(...))`` answers:

- ``GET /v1/models``: one model, ``FakeConfig.model_id``;
- ``POST /v1/completions`` and ``/v1/chat/completions`` (``stream: true`` only): after
  ``first_chunk_delay_s``, ``max_tokens`` tokens in chunks of ``tokens_per_chunk``, one chunk every
  ``chunk_delay_s``, then a usage chunk (``prompt_tokens``: the prompt's ids, or the words of the chat
  message; ``cached_tokens``: :func:`cached_tokens`) and ``data: [DONE]``. Chat streams start with a
  role-only chunk sent at once (it carries no text, so it is not a first token).

Misbehaviour on demand, chosen by ``max_tokens`` (``max_completion_tokens`` for chat):
``BAD_REQUEST_TOKENS`` -> 400 in OpenAI's error shape; ``MALFORMED_TOKENS`` -> one good chunk then a
``data:`` line that is not JSON; ``ERROR_EVENT_TOKENS`` -> one good chunk then an error event;
``RESET_TOKENS`` -> one good chunk then the connection is dropped mid-body.

``app.state.stats`` (:class:`FakeStats`) records every request body and the peak number of requests in
flight. ``serve_in_thread(app)`` runs it under uvicorn on 127.0.0.1 (a free port) in a daemon thread
that stops when the ``with`` block ends, or by itself after ``max_lifetime_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

BAD_REQUEST_TOKENS = 13
MALFORMED_TOKENS = 17
ERROR_EVENT_TOKENS = 19
RESET_TOKENS = 23


@dataclass(frozen=True, slots=True)
class FakeConfig:
    model_id: str = "fake-model"
    first_chunk_delay_s: float = 0.05
    chunk_delay_s: float = 0.02
    tokens_per_chunk: int = 2


@dataclass(slots=True)
class FakeStats:
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def enter(self) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        self.in_flight -= 1


def cached_tokens(prompt_tokens: int) -> int:
    """What the fake reports as prefix-cache hits: half the prompt, rounded down to 16-token blocks."""
    return prompt_tokens // 2 // 16 * 16


def make_app(cfg: FakeConfig = FakeConfig()) -> FastAPI:
    app = FastAPI()
    app.state.stats = FakeStats()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": cfg.model_id, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        return _answer(cfg, app.state.stats, body, int(body.get("max_tokens", 16)),
                       len(body.get("prompt", [])), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        words = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
        return _answer(cfg, app.state.stats, body, int(body.get("max_completion_tokens", 16)),
                       words, chat=True)

    return app


def _answer(cfg: FakeConfig, stats: FakeStats, body: dict[str, Any], max_tokens: int,
            prompt_tokens: int, chat: bool) -> Any:
    stats.bodies.append(body)
    if max_tokens == BAD_REQUEST_TOKENS:
        return JSONResponse(status_code=400, content={"error": {
            "message": f"max_tokens={max_tokens} is refused by the fake server",
            "type": "BadRequestError", "param": "max_tokens", "code": 400}})
    stats.enter()
    return StreamingResponse(_stream(cfg, stats, max_tokens, prompt_tokens, chat),
                             media_type="text/event-stream")


async def _stream(cfg: FakeConfig, stats: FakeStats, max_tokens: int, prompt_tokens: int,
                  chat: bool) -> AsyncIterator[str]:
    try:
        if chat:
            yield _event(_chunk(cfg, chat, "", None, role=True))
        await asyncio.sleep(cfg.first_chunk_delay_s)
        sent = 0
        while sent < max_tokens:
            if sent:
                await asyncio.sleep(cfg.chunk_delay_s)
            n = min(cfg.tokens_per_chunk, max_tokens - sent)
            sent += n
            yield _event(_chunk(cfg, chat, "tok " * n, "length" if sent == max_tokens else None))
            if max_tokens in (MALFORMED_TOKENS, ERROR_EVENT_TOKENS, RESET_TOKENS):
                async for line in _misbehave(max_tokens):
                    yield line
        yield _event(_usage(cfg, prompt_tokens, max_tokens))
        yield "data: [DONE]\n\n"
    finally:
        stats.leave()


async def _misbehave(max_tokens: int) -> AsyncIterator[str]:
    if max_tokens == MALFORMED_TOKENS:
        yield "data: {this is not json\n\n"
    elif max_tokens == ERROR_EVENT_TOKENS:
        yield _event({"error": {"message": "the fake engine died", "type": "InternalServerError",
                                "code": 500}})
    raise RuntimeError("the fake server drops the connection")  # uvicorn aborts the body


def _chunk(cfg: FakeConfig, chat: bool, text: str, finish: str | None, role: bool = False) -> dict:
    if chat:
        delta: dict[str, str] = {"role": "assistant", "content": ""} if role else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": cfg.model_id, "choices": [choice], "usage": None}


def _usage(cfg: FakeConfig, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
            "model": cfg.model_id, "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": cached_tokens(prompt_tokens)}}}


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of the call)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, max_lifetime_s: float = 120.0) -> Iterator[str]:
    """Serves ``app`` on 127.0.0.1 (a free port) and yields its base URL; stops on exit, or by
    itself after ``max_lifetime_s``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    watchdog = threading.Timer(max_lifetime_s, lambda: setattr(server, "should_exit", True))
    watchdog.daemon = True
    thread.start()
    watchdog.start()
    try:
        _wait_started(server)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        watchdog.cancel()
        thread.join(timeout=10)
        sock.close()


def _wait_started(server: uvicorn.Server, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the fake server did not start")
        time.sleep(0.01)
