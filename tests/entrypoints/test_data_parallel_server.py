"""A 2-replica server (``--data-parallel-size 2``): the same greedy tokens as one engine,
per-replica health and metrics, a replica killed mid-stream, no process left after SIGTERM."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from server_fixture import LiveServer, start_server, stop_server

from twinserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Hello, my name is", "Water boils at"]
MAX_TOKENS = 8
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    srv = start_server(["--data-parallel-size", "2"])
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def expected() -> list[str]:
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].text for o in outs]


def complete(server: LiveServer, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return httpx.post(server.url("/v1/completions"), json=body, timeout=120)


def stream_events(server: LiveServer, prompt: str, max_tokens: int) -> list[dict]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    events = []
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def replica_pids(server: LiveServer) -> list[int]:
    return [p.pid for p in psutil.Process(server.process.pid).children(recursive=True)
            if p.name() != "resource_tracker" and "resource_tracker" not in " ".join(p.cmdline())]


def wait_health(server: LiveServer, status: int, timeout_s: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(server.url("/health"), timeout=10)
        if r.status_code == status:
            return r.json()
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)


def test_health_and_metrics_report_each_replica(server: LiveServer) -> None:
    # first in this module: a replica that has served nothing yet shows zero gauges too
    health = wait_health(server, 200)
    assert [(r["engine"], r["state"]) for r in health["replicas"]] == [("0", "ready"),
                                                                       ("1", "ready")]
    text = httpx.get(server.url("/metrics"), timeout=30).text
    for engine in ("0", "1"):
        assert any(line.startswith("vllm:num_requests_running{") and f'engine="{engine}"' in line
                   for line in text.splitlines())
    assert "vllm:time_to_first_token_seconds_count" in text
    # each replica's own cache (the server's flags), not the front's engine, which holds none
    infos = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert sorted(line.split('engine="')[1][0] for line in infos) == ["0", "1"]
    sizes = [int(line.split('kv_cache_memory_bytes="')[1].split('"')[0]) for line in infos]
    assert all(0.99 * (256 << 20) < size <= 256 << 20 for size in sizes), infos  # (whole blocks)


def test_greedy_tokens_equal_one_engines(server: LiveServer, expected: list[str]) -> None:
    texts = [complete(server, p).json()["choices"][0]["text"] for p in PROMPTS]
    assert texts == expected
    streamed = ["".join(e["choices"][0]["text"] for e in stream_events_greedy(server, p))
                for p in PROMPTS]
    assert streamed == expected
    # each request's histograms and counters under the replica that served it (vLLM's label)
    text = httpx.get(server.url("/metrics"), timeout=30).text
    served = {engine: _count(text, "vllm:time_to_first_token_seconds_count", engine)
              for engine in ("0", "1")}
    assert sum(served.values()) == 2 * len(PROMPTS)
    for engine, n in served.items():
        success = f'vllm:request_success_total{{engine="{engine}",finished_reason="length"'
        assert _count(text, success, None) == n
        assert (_count(text, "vllm:iteration_tokens_total_count", engine) > 0) == (n > 0)


def _count(text: str, prefix: str, engine: str | None) -> float:
    """The value of the one sample starting with ``prefix`` (and ``engine``'s label, if given)."""
    found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith(prefix) and (engine is None or f'engine="{engine}"' in line)]
    assert len(found) == 1, (prefix, engine, found)
    return found[0]


def stream_events_greedy(server: LiveServer, prompt: str) -> list[dict]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=120) as r:
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_replica_killed_mid_stream_ends_its_streams_and_the_server_serves_on(
        server: LiveServer) -> None:
    wait_health(server, 200)
    results: list[list[dict]] = [[], []]

    def run(i: int) -> None:
        results[i] = stream_events(server, f"Count with me: {i}, ", 200)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(3.0)  # both streams under way, one per replica (round-robin)
    pids = replica_pids(server)
    assert len(pids) == 2
    victim = psutil.Process(pids[0])
    victim.send_signal(signal.SIGKILL)
    health = wait_health(server, 503)
    assert "error" in health and any(r["state"] != "ready" for r in health["replicas"])
    for t in threads:
        t.join(timeout=180)
    errors = [r for r in results if r and "error" in r[-1]]
    complete_ = [r for r in results if r and "error" not in r[-1]]
    assert len(errors) == 1 and errors[0][-1]["error"]["code"] == 503
    assert len(complete_) == 1
    assert sum(len(e["choices"][0]["text"]) > 0 for e in complete_[0]) > 100
    ok = complete(server, PROMPTS[0])
    assert ok.status_code == 200  # the other replica serves while the dead one restarts
    health = wait_health(server, 200)
    assert sorted(r["restarts"] for r in health["replicas"]) == [0, 1]
    assert not psutil.pid_exists(victim.pid)  # reaped, not a zombie


def test_sigterm_leaves_no_process() -> None:
    srv = start_server(["--data-parallel-size", "2", "--no-restart-dead-replicas"])
    children = [p.pid for p in psutil.Process(srv.process.pid).children(recursive=True)]
    assert len(children) >= 2
    srv.process.send_signal(signal.SIGTERM)
    srv.process.wait(timeout=60)
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) for p in children):
        assert time.monotonic() < deadline, [p for p in children if psutil.pid_exists(p)]
        time.sleep(0.2)
    stop_server(srv)
