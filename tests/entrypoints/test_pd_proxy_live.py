"""vLLM's way, live: a producer and a consumer started as separate ``serve`` processes and
``twinserve pd-proxy`` in front. Greedy output through the proxy equals one engine's (the
producer answering the same request alone), streamed and not, completions and chat; with the
decode instance killed the proxy answers 503 at once, naming it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_fixture import LiveServer, free_port, start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "proxy-test-key"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def deployment() -> Iterator[tuple[LiveServer, LiveServer, LiveServer]]:
    kv_port = free_port()
    # the consumer fails a request whose load failed rather than recomputing it: the tokens
    # below then come from the producer's KV
    roles = [f'{{"kv_role": "kv_producer", "kv_port": {kv_port}}}',
             '{"kv_role": "kv_consumer", "kv_load_failure_policy": "fail"}']
    with ThreadPoolExecutor(2) as pool:  # both engines load at once
        producer, consumer = pool.map(
            lambda cfg: start_server(["--kv-transfer-config", cfg], api_key=KEY), roles)
    proxy = start_proxy(producer, consumer)
    try:
        yield producer, consumer, proxy
    finally:
        for server in (proxy, consumer, producer):
            stop_server(server)


def start_proxy(producer: LiveServer, consumer: LiveServer) -> LiveServer:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="twinserve-proxy-", suffix=".log", delete=False)
    process = subprocess.Popen(
        [sys.executable, "-m", "twinserve.entrypoints.pd_proxy", "--prefill", producer.base_url,
         "--decode", consumer.base_url, "--port", str(port), "--api-key", KEY, "--timeout", "60"],
        stdout=log, stderr=subprocess.STDOUT)
    log.close()
    proxy = LiveServer(f"http://127.0.0.1:{port}", KEY, process, Path(log.name))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, proxy.log_tail()
        try:
            if httpx.get(proxy.url("/health"), timeout=2).status_code == 200:
                return proxy
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_server(proxy)
    raise TimeoutError(f"proxy not healthy:\n{proxy.log_tail()}")


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": MODEL, "temperature": 0, **body},
                      headers=server.headers, timeout=60)


def streamed(server: LiveServer, path: str, body: dict) -> str:
    body = {"model": MODEL, "temperature": 0, "stream": True, **body}
    pieces = []
    with httpx.stream("POST", server.url(path), json=body, headers=server.headers,
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(pieces)


def test_the_proxy_gives_one_engines_tokens(deployment) -> None:
    producer, _, proxy = deployment
    completion = {"prompt": PROMPT, "max_tokens": 12}
    alone = post(producer, "/v1/completions", completion).json()["choices"][0]["text"]
    r = post(proxy, "/v1/completions", completion)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == alone and len(alone) > 0
    assert streamed(proxy, "/v1/completions", completion) == alone
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 10}
    alone = post(producer, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    r = post(proxy, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == alone
    assert streamed(proxy, "/v1/chat/completions", chat) == alone
    assert httpx.post(proxy.url("/v1/completions"), json=completion, timeout=10).status_code == 401


def test_a_dead_decode_instance_gets_an_error_not_a_hang(deployment) -> None:
    _, consumer, proxy = deployment
    os.kill(consumer.process.pid, signal.SIGKILL)
    consumer.process.wait(10)
    start = time.monotonic()
    r = post(proxy, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 503 and consumer.base_url in r.json()["error"]["message"]
    r = post(proxy, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    assert time.monotonic() - start < 15
    assert httpx.get(proxy.url("/health"), timeout=10).status_code == 503
