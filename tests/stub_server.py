"""A real HTTP server on loopback over a stub engine (no model): uvicorn in a thread, the same
``build_app`` as ``twinserve serve``. For the overload and hostile-input tests, where what
matters is the HTTP layer and the engine's answers, not the tokens.

    engine = StubEngine(max_live=2, start_after_s=1.0)
    with serve(engine, max_tenants=4) as base_url:
        httpx.post(base_url + "/v1/completions", json={"prompt": [1], "max_tokens": 2})
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from twinserve.core.errors import EngineOverloaded
from twinserve.core.request_output import CompletionOutput, RequestOutput
from twinserve.core.scheduler import SchedulerStats
from twinserve.core.step_driver import RunRecorder

STARTUP_TIMEOUT_S = 20.0


class StubEngine:
    """Just enough of ``LLMEngine``: token-id prompts, one token (id 7) per step for each
    sample of each live request. ``max_live``: more live requests are refused with ``EngineOverloaded``;
    ``start_after_s``: requests stay queued (no output) that long after they arrive;
    ``step_s``: each step sleeps that long (so the engine thread does not spin)."""

    def __init__(self, max_live: int | None = None, start_after_s: float = 0.0,
                 step_s: float = 0.005, retry_after_s: float = 2.5) -> None:
        self.runner = SimpleNamespace(max_model_len=64, vocab_size=100, model_dir="stub-dir")
        self.config = SimpleNamespace(max_num_seqs=8)
        self.tokenizer = None
        self.policy = SimpleNamespace(uses_priority=False, name="stub")
        self.scheduler = SimpleNamespace(
            stats=lambda: SchedulerStats(len(self.live), 0, 0.0, 0, 0, 0, 0, 0),
            kv=SimpleNamespace(reset_prefix_cache=lambda: True), num_queued=0,
            free_seats=lambda: 0, config=SimpleNamespace(max_waiting_requests=None))
        self.metrics = RunRecorder()
        self.max_live = max_live
        self.start_after_s = start_after_s
        self.step_s = step_s
        self.retry_after_s = retry_after_s
        self.added: list[dict[str, Any]] = []
        self.refused = 0
        self.aborted: list[str] = []
        self.live: dict[str, tuple[list[int], Any, list[int], float]] = {}

    def add_request(self, prompt: list[int], params: Any, *, request_id: str,
                    **kwargs: Any) -> str:
        if self.max_live is not None and len(self.live) >= self.max_live:
            self.refused += 1
            raise EngineOverloaded(f"the waiting queue is full ({self.max_live} requests)",
                                   "max_waiting_requests", self.retry_after_s)
        self.added.append({"request_id": request_id, "prompt": prompt, "params": params,
                           **kwargs})
        self.live[request_id] = (prompt, params, [], time.monotonic() + self.start_after_s)
        return request_id

    def abort_request(self, request_id: str) -> None:
        if self.live.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        now = time.monotonic()
        outs = []
        for rid, (prompt, params, tokens, start) in list(self.live.items()):
            if now < start:
                continue
            tokens.append(7)
            done = len(tokens) >= params.max_tokens
            comps = [CompletionOutput(i, "", list(tokens), delta_token_ids=[7],
                                      finish_reason="length" if done else None)
                     for i in range(params.n)]
            outs.append(RequestOutput(rid, None, prompt, comps, finished=done))
            if done:
                del self.live[rid]
        return outs


class ExplodingRunner:
    """A model runner whose every use fails: how an internal error reaches the server."""

    max_model_len = 64
    model_dir = "stub-dir"

    @property
    def vocab_size(self) -> int:
        raise RuntimeError("secret internal detail")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(engine: StubEngine, **args: Any) -> Iterator[str]:
    """``build_app`` over ``engine`` served by uvicorn on 127.0.0.1; yields the base URL."""
    import uvicorn

    from twinserve.entrypoints.openai.async_engine import AsyncEngine
    from twinserve.entrypoints.openai.server import build_app
    port = free_port()
    async_engine = AsyncEngine(engine)  # type: ignore[arg-type]
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None
    try:
        app = build_app(async_engine, argparse.Namespace(**{"host": "127.0.0.1", **args}))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the stub server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(timeout=10)
        async_engine.shutdown()
