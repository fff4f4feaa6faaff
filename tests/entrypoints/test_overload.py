"""Overload at the server: a full waiting queue is a 503 with ``Retry-After`` (and leaves nothing
in the engine), a tenant's limits are 429s, a call's prompt count is capped, streams send their
headers before the first token and keep-alive comments while queued, and a request aborted while
still waiting is counted. Real HTTP on loopback over a stub engine (tests/stub_server.py)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from stub_server import StubEngine, serve


def _metric(base_url: str, name: str, label: str) -> float:
    """The value of ``name{...label...}`` (``label`` such as ``reason="max_tenants"``)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name}{{{label}}}")


def _error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind and error["code"] == status
    return error


class _Streams:
    """Streaming requests held open in threads (each reads until done or ``stop``)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.statuses: list[int] = []
        self.started = threading.Semaphore(0)

    def open(self, body: dict, headers: dict | None = None) -> None:
        def run() -> None:
            with httpx.stream("POST", self.base_url + "/v1/completions",
                              json={**body, "stream": True}, headers=headers or {},
                              timeout=30) as r:
                self.statuses.append(r.status_code)
                self.started.release()
                for _ in r.iter_lines():
                    if self.stop.is_set():
                        return
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)
        assert self.started.acquire(timeout=10), "no response headers"

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=15)


def test_full_queue_is_503_with_retry_after_and_leaves_nothing_in_the_engine() -> None:
    engine = StubEngine(max_live=2, start_after_s=30.0)  # two requests fill the queue
    with serve(engine) as url:
        streams = _Streams(url)
        try:
            streams.open({"prompt": [1], "max_tokens": 4})
            streams.open({"prompt": [2], "max_tokens": 4})
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/completions", json={"prompt": [3], "max_tokens": 4},
                           timeout=10)
            assert time.monotonic() - t0 < 5  # at once, not after the queue drains
            error = _error(r, 503, "ServiceUnavailableError")
            assert r.headers["retry-after"] == "3"  # ceil(2.5)
            assert "overloaded" in error["message"]
            # a multi-prompt call whose last prompt is refused: the others are aborted
            r = httpx.post(url + "/v1/completions",
                           json={"prompt": [[4], [5]], "max_tokens": 4}, timeout=10)
            _error(r, 503, "ServiceUnavailableError")
            r = httpx.post(url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}]}, timeout=10)
            assert r.status_code == 400  # no tokenizer: refused before the engine
            assert _metric(url, "twinserve:request_rejected_total",
                           'reason="max_waiting_requests"') == 2  # one per API call
        finally:
            streams.close()
        deadline = time.monotonic() + 10
        while engine.live and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.live == {}  # the held streams were aborted when their clients left
    assert engine.refused == 3  # [3], then [4] and [5] of the two-prompt call
    assert [a["prompt"] for a in engine.added] == [[1], [2]]


def test_admitted_requests_all_end_and_a_rejected_one_leaves_nothing() -> None:
    engine = StubEngine(max_live=3)
    with serve(engine) as url:
        results = []

        def one(i: int) -> None:
            r = httpx.post(url + "/v1/completions", json={"prompt": [i], "max_tokens": 20},
                           timeout=30)
            results.append(r.status_code)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(results) == 12 and set(results) <= {200, 503}
        assert results.count(200) == len(engine.added) - len(engine.aborted)
        assert results.count(503) == engine.refused
        assert engine.live == {}


def test_prompt_count_is_capped() -> None:
    engine = StubEngine()
    with serve(engine, max_prompts_per_request=4) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": [[1]] * 5, "max_tokens": 1},
                       timeout=10)
        error = _error(r, 400, "BadRequestError")
        assert error["param"] == "prompt" and "--max-prompts-per-request" in error["message"]
        r = httpx.post(url + "/v1/completions",
                       json={"prompt": [[1], [2]], "n": 3, "max_tokens": 1}, timeout=10)
        assert _error(r, 400, "BadRequestError")["param"] == "prompt"
        r = httpx.post(url + "/v1/completions",
                       json={"prompt": [[1], [2]], "n": 2, "max_tokens": 1}, timeout=10)
        assert r.status_code == 200, r.text
    assert len(engine.added) == 2


def test_default_prompt_cap_refuses_20000_prompts_before_queueing_any() -> None:
    engine = StubEngine()
    with serve(engine, max_request_body_bytes=1 << 20) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": [[1]] * 20_000,
                                                      "max_tokens": 16}, timeout=30)
        assert "256" in _error(r, 400, "BadRequestError")["message"]
    assert engine.added == []


def test_streams_send_headers_at_once_and_keep_alive_while_queued() -> None:
    engine = StubEngine(start_after_s=1.5)
    with serve(engine, sse_keepalive_s=0.2) as url:
        t0 = time.monotonic()
        lines: list[tuple[float, str]] = []
        with httpx.stream("POST", url + "/v1/completions",
                          json={"prompt": [1], "max_tokens": 2, "stream": True},
                          timeout=30) as r:
            headers_after = time.monotonic() - t0
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line:
                    lines.append((time.monotonic() - t0, line))
        assert headers_after < 1.0  # the first token comes after 1.5 s
        first_data = next(t for t, line in lines if line.startswith("data: {"))
        assert first_data >= 1.4
        keepalives = [t for t, line in lines if line == ": keep-alive"]
        assert len(keepalives) >= 3 and all(t < first_data for t in keepalives)
        assert lines[-1][1] == "data: [DONE]"


def test_chat_stream_of_a_refused_request_is_a_status_code_not_a_stream() -> None:
    engine = StubEngine(max_live=0)
    with serve(engine) as url, httpx.stream("POST", url + "/v1/completions",
                      json={"prompt": [1], "max_tokens": 2, "stream": True},
                      timeout=10) as r:
        assert r.status_code == 503
        assert "retry-after" in r.headers


def test_tenants_are_bounded_and_limited() -> None:
    engine = StubEngine(start_after_s=30.0)
    with serve(engine, max_tenants=2, max_requests_per_tenant=2) as url:
        streams = _Streams(url)
        try:
            streams.open({"prompt": [1], "max_tokens": 2, "user": "a"})
            streams.open({"prompt": [1], "max_tokens": 2, "user": "b"},
                         headers={"X-Tenant": "c"})  # not trusted: tenant b
            assert streams.statuses == [200, 200]
            r = httpx.post(url + "/v1/completions",
                           json={"prompt": [1], "max_tokens": 2, "user": "c"}, timeout=10)
            error = _error(r, 429, "RateLimitError")
            assert "--max-tenants" in error["message"] and r.headers["retry-after"] == "1"
            streams.open({"prompt": [1], "max_tokens": 2, "user": "a"})  # a known tenant
            r = httpx.post(url + "/v1/completions",
                           json={"prompt": [1], "max_tokens": 2, "user": "a"}, timeout=10)
            assert "--max-requests-per-tenant" in _error(r, 429, "RateLimitError")["message"]
            r = httpx.post(url + "/v1/completions",
                           json={"prompt": [1], "max_tokens": 2, "user": "x" * 300},
                           timeout=10)
            assert _error(r, 400, "BadRequestError")["param"] == "user"
        finally:
            streams.close()
        assert sorted(a["tenant"] for a in engine.added) == ["a", "a", "b"]
        engine.start_after_s = 0.0
        deadline = time.monotonic() + 10
        while True:  # once their requests are gone, the tenants' slots are free again
            r = httpx.post(url + "/v1/completions",
                           json={"prompt": [1], "max_tokens": 2, "user": "c"}, timeout=10)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text


def test_trusted_tenant_header() -> None:
    engine = StubEngine()
    with serve(engine, trust_tenant_header=True) as url:
        r = httpx.post(url + "/v1/completions",
                       json={"prompt": [1], "max_tokens": 1, "user": "u"},
                       headers={"X-Tenant": "gold"}, timeout=10)
        assert r.status_code == 200
    assert engine.added[0]["tenant"] == "gold"


def test_abort_while_waiting_is_counted() -> None:
    engine = StubEngine(start_after_s=30.0)
    with serve(engine) as url:
        aborted = ("vllm:request_success_total", 'finished_reason="abort"')
        before = _metric(url, *aborted)
        with pytest.raises(httpx.TimeoutException):  # still queued when the client gives up
            httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 2, "n": 2},
                       timeout=1.0)
        streams = _Streams(url)
        streams.open({"prompt": [1], "max_tokens": 2})
        streams.close()
        deadline = time.monotonic() + 10
        while engine.live and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.live == {}
        assert _metric(url, *aborted) == before + 3  # n=2 samples, then one stream


def test_a_full_queue_is_refused_before_the_engine_thread_takes_the_request() -> None:
    """In a burst the engine thread reads commands only between steps: the async front counts
    the adds in flight against max_waiting_requests and says "not now" at once."""
    import asyncio
    from types import SimpleNamespace

    from twinserve.core.errors import EngineOverloaded
    from twinserve.entrypoints.openai.async_engine import AsyncEngine

    in_step, release = threading.Event(), threading.Event()

    class Busy:  # an engine thread held inside a long step for the whole burst
        scheduler = SimpleNamespace(num_queued=1, free_seats=lambda: 0,
                                    config=SimpleNamespace(max_waiting_requests=3))

        def has_unfinished_requests(self) -> bool:
            return not release.is_set()

        def step(self) -> list:
            in_step.set()
            release.wait(10)
            return []

        def add_request(self, *args, **kwargs) -> str:
            return "added"

    engine = AsyncEngine(Busy())  # type: ignore[arg-type]
    try:
        assert in_step.wait(10)

        async def burst() -> list[str]:
            results = []
            for i in range(5):
                stream = engine.submit([1, 2], None, f"r{i}")  # type: ignore[arg-type]
                if not stream._queue.qsize():  # no answer yet: it waits for the engine thread
                    results.append("queued")
                    continue
                with pytest.raises(EngineOverloaded) as info:
                    await asyncio.wait_for(stream.accepted(), 1)
                results.append(info.value.reason)
            return results
        # 1 waiting + 2 in flight reach the bound of 3: the rest is refused at once
        assert asyncio.run(burst()) == ["queued", "queued"] + ["max_waiting_requests"] * 3
    finally:
        release.set()
        engine.shutdown()
