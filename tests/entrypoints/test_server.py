"""The OpenAI-compatible server, live: the official ``openai`` client, a bad-input matrix,
client disconnects, and 200 concurrent streams with the metrics checked against them.

One server process (the default model, small settings, fcfs, an API key) serves the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_fixture import LiveServer, live_server, start_server, stop_server
from stub_server import ExplodingRunner

from twinserve.core.step_driver import RunRecorder

API_KEY = "test-key-123"
BODY_LIMIT = 65536
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(["--max-request-body-bytes", str(BODY_LIMIT),
                      "--served-model-name", "smol"], api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, timeout=120,
                         max_retries=0)


def metric_values(server: LiveServer) -> dict[str, float]:
    """``{"name{labels}": value}`` of the ``vllm:`` samples, labels without ``model_name``."""
    text = httpx.get(server.url("/metrics"), timeout=60).text
    values = {}
    for line in text.splitlines():
        match = re.match(r"^(vllm:[^{ ]+)(?:\{([^}]*)\})? (\S+)$", line)
        if match:
            name, labels, value = match.groups()
            labels = ",".join(p for p in (labels or "").split(",")
                              if p and not p.startswith("model_name="))
            values[f"{name}{{{labels}}}" if labels else name] = float(value)
    return values


def wait_idle(server: LiveServer, timeout_s: float = 60.0) -> dict[str, float]:
    """Polls /metrics until nothing runs or waits and no KV block is in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metric_values(server)
        idle = (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def post(server: LiveServer, path: str, body: object = None, *, content: bytes | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    hdrs = {**server.headers, **(headers or {})}
    if content is not None:
        hdrs.setdefault("Content-Type", "application/json")
        return httpx.post(server.url(path), content=content, headers=hdrs, timeout=120)
    return httpx.post(server.url(path), json=body, headers=hdrs, timeout=120)


def good_request_succeeds(server: LiveServer) -> None:
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


# ---- the official client ---------------------------------------------------------------------
def test_completions_sync_and_stream_agree(server: LiveServer, client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    n_prompt = post(server, "/tokenize", {"prompt": prompt}).json()["count"]
    full = client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0)
    choice = full.choices[0]
    assert choice.text.strip()
    assert choice.finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens == n_prompt
    assert 1 <= full.usage.completion_tokens <= 8
    assert full.usage.total_tokens == n_prompt + full.usage.completion_tokens
    if choice.finish_reason == "length":
        assert full.usage.completion_tokens == 8

    stream = client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_sync_and_stream_agree(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    full = client.chat.completions.create(model="smol", messages=messages, max_tokens=8,
                                          temperature=0)
    content = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert content and content.strip()
    assert full.usage.prompt_tokens > 10  # the template's system prompt and markers
    assert 1 <= full.usage.completion_tokens <= 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = client.chat.completions.create(model="smol", messages=messages,
                                            max_completion_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # the same prompt again: its full blocks come from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_chat_logprobs_and_completion_extras(server: LiveServer, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)  # greedy

    r = post(server, "/v1/completions", {
        "prompt": [[19556, 905], [19556]], "max_tokens": 3, "n": 1, "logprobs": 1,
        "echo": True, "seed": 7, "top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1,
        "ignore_eos": True, "min_tokens": 1, "stop_token_ids": [0],
        "skip_special_tokens": True, "include_stop_str_in_output": False, "user": "alice"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"].startswith("Hello world")  # token ids, decoded for echo
    assert body["choices"][1]["text"].startswith("Hello")
    for choice, prompt_len in zip(body["choices"], (2, 1)):  # echo: the prompt's tokens first
        assert len(choice["logprobs"]["tokens"]) == prompt_len + 3
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["tokens"][0] == "Hello"
        assert choice["logprobs"]["text_offset"][0] == 0
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["prompt_tokens"] == 2 + 1
    batch = client.completions.create(model="smol", prompt=["Hi", "Bye"], max_tokens=2,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]

    seeded = [client.completions.create(model="smol", prompt="Once", max_tokens=4,
                                        temperature=1.0, seed=1234).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]

    stopped = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=16,
                                        temperature=0, stop=[","])
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_n_samples_each_get_max_tokens(server: LiveServer) -> None:
    r = post(server, "/v1/completions", {"prompt": ["Hi", "Bye"], "max_tokens": 3, "n": 2,
                                         "ignore_eos": True, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 12
    assert all(c["finish_reason"] == "length" for c in body["choices"])


def test_models_health_version_tokenize(server: LiveServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["smol"]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/version")).json()["version"]
    tokens = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat_tokens = post(server, "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
    assert chat_tokens.json()["count"] > 5
    reset = post(server, "/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json()["reset"] is True


# ---- bad input -------------------------------------------------------------------------------
LONG_PROMPT = "hello " * 300  # ~300 tokens > max_model_len 256

BAD_INPUTS = [
    # (id, path, json body or raw bytes, headers, status, message substring, param)
    ("malformed-json", "/v1/completions", b'{"prompt": "Hi", ', None, 400, "Malformed JSON",
     None),
    ("not-an-object", "/v1/completions", b"[1, 2]", None, 400, "Invalid request", None),
    ("wrong-type-max-tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, None,
     400, "max_tokens", "max_tokens"),
    ("wrong-type-prompt", "/v1/completions", {"prompt": {"a": 1}}, None, 400, "prompt",
     "prompt"),
    ("missing-prompt", "/v1/completions", {"max_tokens": 4}, None, 400, "Field required",
     "prompt"),
    ("missing-messages", "/v1/chat/completions", {"max_tokens": 4}, None, 400,
     "Field required", "messages"),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, None, 400, "at least 1",
     "messages"),
    ("negative-max-tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": -1}, None, 400,
     "max_tokens must be at least 1", "max_tokens"),
    ("huge-max-tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": 10**9}, None, 400,
     "This model's maximum context length is 256 tokens. However, you requested 1000000001 "
     "tokens (1 in the messages, 1000000000 in the completion). Please reduce the length of the "
     "messages or completion.", "max_tokens"),
    ("chat-huge-max-completion-tokens", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 10**6}, None,
     400, "maximum context length is 256 tokens", "max_completion_tokens"),
    ("prompt-over-max-model-len", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4},
     None, 400, "in the messages, 4 in the completion). Please reduce the length", "max_tokens"),
    ("prompt-over-max-model-len-no-max-tokens", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": LONG_PROMPT}]}, None, 400,
     "maximum context length is 256 tokens", "messages"),
    ("bad-top-p", "/v1/completions", {"prompt": "Hi", "top_p": 2}, None, 400,
     "top_p must be in (0, 1]", "top_p"),
    ("bad-temperature", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "temperature": -1}, None, 400,
     "temperature", "temperature"),
    ("token-id-out-of-vocab", "/v1/completions", {"prompt": [10**7]}, None, 400,
     "prompt token ids must be in", "prompt"),
    ("stream-options-without-stream", "/v1/completions",
     {"prompt": "Hi", "stream_options": {"include_usage": True}}, None, 400,
     "Stream options can only be defined when `stream=True`.", "stream_options"),
    # inputs that would otherwise fail inside an engine step and stop the engine for everyone
    ("logprobs-over-max", "/v1/completions", {"prompt": "Hi", "logprobs": 10**6}, None, 400,
     "less than or equal to 20", "logprobs"),
    ("top-logprobs-over-max", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 99},
     None, 400, "less than or equal to 20", "top_logprobs"),
    ("seed-over-int64", "/v1/completions", {"prompt": "Hi", "seed": 2**64}, None, 400, "seed",
     "seed"),
    ("stop-token-id-out-of-vocab", "/v1/completions",
     {"prompt": "Hi", "stop_token_ids": [10**7], "min_tokens": 2}, None, 400,
     "stop_token_ids must be in", "stop_token_ids"),
    ("n-over-max-num-seqs", "/v1/completions", {"prompt": "Hi", "n": 10**6}, None, 400,
     "exceeds max_num_seqs", "n"),
    ("unknown-model", "/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, None, 404,
     "The model `gpt-4` does not exist.", "model"),
    ("priority-without-priority-policy", "/v1/completions", {"prompt": "Hi", "priority": 5},
     None, 400, "does not use priorities", "priority"),
    ("bad-api-key", "/v1/completions", {"prompt": "Hi"}, {"Authorization": "Bearer nope"},
     401, "API key", None),
    ("missing-api-key", "/v1/chat/completions", {"messages": []}, {"Authorization": ""}, 401,
     "API key", None),
    ("oversized-body", "/v1/completions", {"prompt": "x" * (BODY_LIMIT + 10)}, None, 413,
     "too large", None),
    ("unknown-route", "/v1/nothing-here", {}, None, 404, "Not Found", None),
]


@pytest.mark.parametrize("path,body,headers,status,message,param",
                         [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_input(server: LiveServer, path: str, body: object, headers: dict[str, str] | None,
                   status: int, message: str, param: str | None) -> None:
    if isinstance(body, bytes):
        r = post(server, path, content=body, headers=headers)
    else:
        r = post(server, path, body, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"]
    assert error["param"] == param
    assert error["code"] == status
    assert "Traceback" not in r.text


def test_oversized_body_without_content_length(server: LiveServer) -> None:
    def chunks() -> Iterator[bytes]:  # chunked transfer: no Content-Length to check up front
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'
    r = httpx.post(server.url("/v1/completions"), content=chunks(),
                   headers={**server.headers, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413


def test_server_keeps_serving_after_bad_input(server: LiveServer) -> None:
    for _ in range(2):
        assert post(server, "/v1/completions", content=b"{oops").status_code == 400
        good_request_succeeds(server)


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smol", prompt="Hi", max_tokens=10**6)
    assert "maximum context length" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)


# ---- disconnects -----------------------------------------------------------------------------
def test_disconnect_mid_stream_aborts(server: LiveServer) -> None:
    before = metric_values(server)
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, headers=server.headers,
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    after = wait_idle(server, timeout_s=30)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[aborted] == before[aborted] + 1
    # far fewer than 200 tokens were generated: the request really stopped
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 1 <= generated < 200


def test_disconnect_while_waiting_for_full_response_aborts(server: LiveServer) -> None:
    before = metric_values(server)
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url("/v1/completions"), json=body, headers=server.headers, timeout=3)
    after = wait_idle(server, timeout_s=30)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[aborted] == before[aborted] + 1


# ---- load ------------------------------------------------------------------------------------
NUM_CONCURRENT = 200


async def _stream_one(client: httpx.AsyncClient, server: LiveServer, i: int) -> dict:
    body = {"model": "smol", "prompt": f"Fact {i}:", "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    text, usage, done = "", None, False
    async with client.stream("POST", server.url("/v1/completions"), json=body,
                             headers=server.headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert done and usage is not None
    return {"text": text, "usage": usage}


async def _poll_health(server: LiveServer, stop: asyncio.Event) -> list[int]:
    codes = []
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            codes.append((await client.get(server.url("/health"))).status_code)
            await asyncio.sleep(0.25)
    return codes


async def _load(server: LiveServer) -> tuple[list[dict], list[int]]:
    limits = httpx.Limits(max_connections=NUM_CONCURRENT, max_keepalive_connections=20)
    stop = asyncio.Event()
    health = asyncio.create_task(_poll_health(server, stop))
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(150, connect=30),
                                     limits=limits) as client:
            results = await asyncio.wait_for(asyncio.gather(
                *(_stream_one(client, server, i) for i in range(NUM_CONCURRENT))), timeout=170)
    finally:
        stop.set()
    return results, await health


def test_200_concurrent_streams(server: LiveServer) -> None:
    before = wait_idle(server)
    results, health = asyncio.run(_load(server))
    assert len(results) == NUM_CONCURRENT
    assert all(r["text"] and r["usage"]["completion_tokens"] >= 1 for r in results)
    assert health and all(code == 200 for code in health)

    after = wait_idle(server)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0  # no leaked block

    def delta(name: str) -> float:
        return after[name] - before[name]
    assert delta("vllm:prompt_tokens_total") == sum(r["usage"]["prompt_tokens"] for r in results)
    assert delta("vllm:generation_tokens_total") == \
        sum(r["usage"]["completion_tokens"] for r in results)
    finished = sum(delta(f'vllm:request_success_total{{finished_reason="{reason}"}}')
                   for reason in ("stop", "length", "abort"))
    assert finished == NUM_CONCURRENT
    assert delta('vllm:request_success_total{finished_reason="abort"}') == 0
    assert delta("vllm:e2e_request_latency_seconds_count") == NUM_CONCURRENT
    assert delta("vllm:time_to_first_token_seconds_count") == NUM_CONCURRENT
    assert delta("vllm:request_queue_time_seconds_count") == NUM_CONCURRENT
    assert delta("vllm:inter_token_latency_seconds_count") == \
        sum(r["usage"]["completion_tokens"] - 1 for r in results)


# ---- in-process apps over a stub engine (no model): engine death, 500s, isolation ------------
class _StubEngine:
    """Just enough of ``LLMEngine`` for ``AsyncEngine`` and the app: token-id prompts, one token
    (id 7) per step. ``fail_on_step`` makes the engine thread die on its first step."""

    def __init__(self, uses_priority: bool = False, fail_on_step: bool = False) -> None:
        from types import SimpleNamespace

        from twinserve.core.scheduler import SchedulerStats
        self.runner = SimpleNamespace(max_model_len=64, vocab_size=100, model_dir="stub-dir")
        self.config = SimpleNamespace(max_num_seqs=8)
        self.tokenizer = None
        self.policy = SimpleNamespace(uses_priority=uses_priority, name="stub")
        self.scheduler = SimpleNamespace(
            stats=lambda: SchedulerStats(len(self.live), 0, 0.0, 0, 0, 0, 0, 0),
            kv=SimpleNamespace(reset_prefix_cache=lambda: True), num_queued=0,
            free_seats=lambda: 0, config=SimpleNamespace(max_waiting_requests=None))
        self.metrics = RunRecorder()
        self.fail_on_step = fail_on_step
        self.added: list[dict] = []
        self.live: dict[str, tuple[list[int], object, list[int]]] = {}

    def add_request(self, prompt: list[int], params: object, *, request_id: str,
                    **kwargs: object) -> str:
        self.added.append({"request_id": request_id, "prompt": prompt, "params": params,
                           **kwargs})
        self.live[request_id] = (prompt, params, [])
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list:
        from twinserve.core.request_output import CompletionOutput, RequestOutput
        if self.fail_on_step:
            raise RuntimeError("stub engine failure")
        outs = []
        for rid, (prompt, params, tokens) in list(self.live.items()):
            tokens.append(7)
            done = len(tokens) >= params.max_tokens
            comp = CompletionOutput(0, "", list(tokens), finish_reason="length" if done else None,
                                    delta_token_ids=[7])
            outs.append(RequestOutput(rid, None, prompt, [comp], finished=done))
            if done:
                del self.live[rid]
        return outs


@contextlib.contextmanager
def _stub_app(engine: _StubEngine, **args: object) -> Iterator[httpx.AsyncClient]:
    import argparse

    from twinserve.entrypoints.openai.async_engine import AsyncEngine
    from twinserve.entrypoints.openai.server import build_app
    async_engine = AsyncEngine(engine)  # type: ignore[arg-type]
    try:
        app = build_app(async_engine, argparse.Namespace(**args))
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        yield httpx.AsyncClient(transport=transport, base_url="http://localhost")
    finally:
        async_engine.shutdown()


def test_priority_and_tenant_reach_the_engine() -> None:
    engine = _StubEngine(uses_priority=True)

    async def run(client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/completions", json={
            "prompt": [1, 2], "max_tokens": 2, "priority": 3, "user": "alice"},
            headers={"X-Tenant": "gold"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                     "total_tokens": 4,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
        r = await client.post("/v1/completions", json={"prompt": [3], "max_tokens": 1,
                                                       "user": "bob"})
        assert r.status_code == 200, r.text
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400  # no tokenizer, so no chat template
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": None})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 64 - 3  # up to max_model_len

    with _stub_app(engine, trust_tenant_header=True) as client:
        asyncio.run(run(client))
    assert [(a["priority"], a["tenant"]) for a in engine.added] == \
        [(3, "gold"), (0, "bob"), (0, "default")]
    assert engine.added[-1]["params"].max_tokens == 64 - 3


def test_dead_engine_answers_503() -> None:
    async def run(client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == 503
        assert (await client.get("/health")).status_code == 503
        r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert r.status_code == 503
        assert (await client.get("/metrics")).status_code == 200

    with _stub_app(_StubEngine(fail_on_step=True)) as client:
        asyncio.run(run(client))


def test_internal_error_is_500_without_traceback() -> None:
    engine = _StubEngine()

    engine.runner = ExplodingRunner()  # type: ignore[assignment]

    async def run(client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert r.status_code == 500
        assert r.json()["error"] == {"message": "Internal server error.",
                                     "type": "InternalServerError", "param": None, "code": 500}
        assert "secret" not in r.text and "Traceback" not in r.text
        assert (await client.get("/health")).status_code == 200

    with _stub_app(engine) as client:
        asyncio.run(run(client))


def test_two_apps_share_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINSERVE_API_KEY", "env-key")

    async def run(first: httpx.AsyncClient, second: httpx.AsyncClient) -> None:
        assert (await first.post("/v1/completions", json={"prompt": [1]})).status_code == 401
        r = await first.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2},
                             headers={"Authorization": "Bearer env-key"})
        assert r.status_code == 200, r.text
        m1 = (await first.get("/metrics")).text
        m2 = (await second.get("/metrics")).text
        assert 'vllm:prompt_tokens_total{model_name="first"} 3.0' in m1
        assert 'vllm:prompt_tokens_total{model_name="second"} 0.0' in m2
        assert 'model_name="first"' not in m2
        r = await second.post("/v1/completions", json={"prompt": [1], "model": "first"},
                              headers={"Authorization": "Bearer other"})
        assert r.status_code == 404

    with _stub_app(_StubEngine(), served_model_name="first") as first, \
            _stub_app(_StubEngine(), served_model_name="second", api_key="other") as second:
        asyncio.run(run(first, second))


def test_logit_bias_and_allowed_token_ids(server: LiveServer, client: openai.OpenAI) -> None:
    """OpenAI's logit_bias (string token ids) and vLLM's allowed_token_ids reach the sampler;
    out-of-range values are 400s naming the field."""
    paris = post(server, "/tokenize", {"prompt": " Paris", "add_special_tokens": False}).json()
    (token,) = paris["tokens"]
    prompt = "The capital of France is"
    forced = client.completions.create(model="smol", prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(token): 100})
    assert forced.choices[0].text == " Paris" * 4
    only = client.completions.create(model="smol", prompt="Hello", max_tokens=3, temperature=0,
                                     extra_body={"allowed_token_ids": [token]})
    assert only.choices[0].text == " Paris" * 3
    for body, field in (({"logit_bias": {str(token): 101}}, "logit_bias"),
                        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                        ({"allowed_token_ids": []}, "allowed_token_ids")):
        r = post(server, "/v1/completions", {"model": "smol", "prompt": "Hi", "max_tokens": 2,
                                              **body})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_a_second_sigint_stops_the_server_without_a_traceback() -> None:
    """Ctrl-C twice, or a supervisor's SIGINT next to the terminal's (``timeout``, a process
    group): the server stops as for one, with no traceback in its output (uvicorn's lifespan
    task, cancelled mid-shutdown, and the SIGINT it raises again once stopped both printed one)."""
    srv = start_server([])
    try:
        srv.process.send_signal(signal.SIGINT)
        time.sleep(0.01)
        srv.process.send_signal(signal.SIGINT)
        srv.process.wait(timeout=60)
        log = srv.log_tail(20_000)
        assert "Traceback" not in log, log
        assert srv.process.returncode in (130, -signal.SIGINT), srv.process.returncode
    finally:
        stop_server(srv)
