"""The P/D proxy's logic against fake instances (httpx.MockTransport): what it sends each
instance, what it relays, and how it answers for an instance that fails."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from fastapi.testclient import TestClient

from twinserve.entrypoints.pd_proxy import PDProxy, ProxyConfig, build_proxy_app

P, D = "http://prefill:1", "http://decode:2"
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [0],
          "remote_host": "127.0.0.1", "remote_port": 14579, "remote_request_id": "r",
          "remote_num_tokens": 5}


def fake(decode: Callable[[dict], httpx.Response] | None = None,
         prefill: Callable[[dict], httpx.Response] | None = None,
         seen: list | None = None) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        if seen is not None:
            seen.append((str(request.url), body, request.headers.get("authorization")))
        if request.url.host == "prefill":
            if prefill is not None:
                return prefill(body)
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
        if decode is not None:
            return decode(body)
        return httpx.Response(200, json={"choices": [{"text": " Paris"}]})
    return httpx.MockTransport(handler)


def client(transport: httpx.MockTransport, api_key: str | None = None, **kw) -> TestClient:
    proxy = PDProxy(ProxyConfig((P,), (D,), api_key, **kw), httpx.AsyncClient(transport=transport))
    return TestClient(build_proxy_app(proxy))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prefill_then_decode_with_the_producers_params(path: str) -> None:
    seen: list = []
    body = {"model": "m", "prompt": "hi", "max_tokens": 16, "max_completion_tokens": 16,
            "temperature": 0, "stream_options": {"include_usage": True}}
    r = client(fake(seen=seen)).post(path, json=body)
    assert r.status_code == 200 and r.json() == {"choices": [{"text": " Paris"}]}
    (purl, pbody, _), (durl, dbody, _) = seen
    assert purl == P + path and durl == D + path
    assert pbody["max_tokens"] == 1 and pbody["max_completion_tokens"] == 1
    assert pbody["stream"] is False and "stream_options" not in pbody
    assert pbody["kv_transfer_params"] == {"do_remote_decode": True}
    assert dbody == {**body, "kv_transfer_params": PARAMS}  # the client's request, as it was


def test_a_stream_comes_back_from_the_decode_instance() -> None:
    events = b'data: {"choices": [{"text": " Pa"}]}\n\ndata: {"choices": [{"text": "ris"}]}\n\n' \
             b"data: [DONE]\n\n"
    seen: list = []
    transport = fake(lambda b: httpx.Response(200, content=events,
                                              headers={"content-type": "text/event-stream"}),
                     seen=seen)
    r = client(transport).post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert r.status_code == 200 and r.content == events
    assert seen[0][1]["stream"] is False and seen[1][1]["stream"] is True


def test_the_api_key_is_asked_for_and_forwarded() -> None:
    seen: list = []
    c = client(fake(seen=seen), api_key="sekrit")
    assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 401
    r = c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200
    assert [auth for _, _, auth in seen] == ["Bearer sekrit"] * 2


def test_instance_errors_come_back_as_they_are() -> None:
    error = {"error": {"message": "max_tokens must be >= 1", "type": "BadRequestError",
                       "param": "max_tokens", "code": 400}}
    r = client(fake(prefill=lambda b: httpx.Response(400, json=error))).post(
        "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and r.json() == error
    r = client(fake(decode=lambda b: httpx.Response(503, json=error))).post(
        "/v1/completions", json={"prompt": "hi", "stream": True})
    assert r.status_code == 503 and r.json() == error


def test_refusals_and_malformed_answers() -> None:
    c = client(fake())
    r = c.post("/v1/completions", json={"prompt": "hi", "kv_transfer_params": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    assert c.post("/v1/completions", content=b"{").status_code == 400
    assert c.post("/v1/completions", json=[1]).status_code == 400
    r = client(fake(prefill=lambda b: httpx.Response(200, json={"choices": []}))).post(
        "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 502 and "kv_producer" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="decode: 'decode:2' is not an http"):
        ProxyConfig((P,), ("decode:2",))
    with pytest.raises(ValueError, match="prefill: give at least one"):
        ProxyConfig((), (D,))


def test_an_unreachable_instance_answers_503_and_is_left_out() -> None:
    calls: list = []

    def refuse(body: dict) -> httpx.Response:
        calls.append(body)
        raise httpx.ConnectError("connection refused")
    c = client(fake(decode=refuse), retry_unhealthy_s=60.0)
    r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503 and D in r.json()["error"]["message"]
    r = c.post("/v1/completions", json={"prompt": "hi"})  # left out: no call, 503 at once
    assert r.status_code == 503 and "No decode instance is reachable" in r.json()["error"]["message"]
    assert len(calls) == 1


def test_a_stream_broken_off_ends_with_an_error_event() -> None:
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"text": " Pa"}]}\n\n'
            raise httpx.ReadError("connection reset")

    r = client(fake(lambda b: httpx.Response(200, stream=Broken()))).post(
        "/v1/completions", json={"prompt": "hi", "stream": True})
    lines = [x for x in r.text.split("\n\n") if x]
    assert lines[0] == 'data: {"choices": [{"text": " Pa"}]}'
    error = json.loads(lines[1].removeprefix("data: "))["error"]
    assert error["code"] == 502 and "broke off the stream" in error["message"]


def test_a_body_over_the_limit_is_refused_before_any_instance_sees_it() -> None:
    seen: list = []
    c = client(fake(seen=seen), max_request_body_bytes=200)
    r = c.post("/v1/completions", json={"prompt": "x" * 500})
    assert r.status_code == 413 and not seen
    assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200 and seen
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        ProxyConfig((P,), (D,), max_request_body_bytes=0)
