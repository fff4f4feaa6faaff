"""vLLM's way to disaggregate: separately started instances behind a proxy.

    twinserve serve --port 8100 --kv-transfer-config '{"kv_role": "kv_producer", "kv_port": 14579}'
    twinserve serve --port 8200 --kv-transfer-config '{"kv_role": "kv_consumer"}'
    twinserve pd-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

As vLLM's disaggregated-serving proxy example: each ``/v1/completions`` and
``/v1/chat/completions`` request goes first to a prefill instance with ``max_tokens`` 1, no
streaming and ``kv_transfer_params: {"do_remote_decode": true}``; the producer's answer carries
the consumer's ``kv_transfer_params``, which go with the original request to a decode instance,
whose answer (streamed or not) is the client's. The prefill instance's token is discarded.
Instances are picked by ``routers/disaggregated.py`` (least-outstanding in each pool, counting
the requests this proxy has in flight on each), the object the one-command front and the twin
route through.

Decisions:
- An instance's error answer (400, 401, 429, 503, ...) comes back as it is: already in
  OpenAI's shape. An unreachable instance answers 503 naming it, and is not routed to for
  ``retry_unhealthy_s`` (with every instance of a pool down: 503 at once); a broken or
  malformed answer is a 502, an answer slower than ``timeout_s`` a 504. A stream the decode
  instance breaks off ends with an error event, not a hang.
- A client's own ``kv_transfer_params`` are refused (400 naming them): the proxy sets them.
- ``--api-key``: the proxy asks clients for it and forwards it to the instances.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from twinserve.core.request import Request as EngineRequest
from twinserve.core.sampling_params import SamplingParams
from twinserve.entrypoints.openai.http_errors import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    error_event,
    error_response,
)
from twinserve.routers import NoHealthyReplica
from twinserve.routers.disaggregated import DisaggregatedRouter, prefill_kv_transfer_params
from twinserve.routers.router import ReplicaLoad

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(slots=True, frozen=True)
class ProxyConfig:
    """The instances' base URLs per pool and the proxy's limits."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    api_key: str | None = None
    timeout_s: float = 600.0  # one instance's answer (a decode's whole stream)
    connect_timeout_s: float = 5.0
    retry_unhealthy_s: float = 5.0  # an unreachable instance is left out this long
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # 413 above, as serve's
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S  # 408 for a body not sent by then

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            urls = getattr(self, name)
            if not urls:
                raise ValueError(f"{name}: give at least one instance URL.")
            for url in urls:
                if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                    raise ValueError(f"{name}: {url!r} is not an http:// or https:// URL.")
            object.__setattr__(self, name, tuple(u.rstrip("/") for u in urls))
        body = self.max_request_body_bytes
        if isinstance(body, bool) or not isinstance(body, int) or body <= 0:
            raise ValueError(f"max_request_body_bytes must be a positive integer, got {body!r}.")
        for name in ("timeout_s", "connect_timeout_s", "retry_unhealthy_s", "body_read_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}.")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty.")


class _Pool:
    """One pool's instances: requests in flight on each, and until when each is left out."""

    __slots__ = ("name", "urls", "in_flight", "down_until")

    def __init__(self, name: str, urls: Sequence[str]) -> None:
        self.name, self.urls = name, tuple(urls)
        self.in_flight = [0] * len(urls)
        self.down_until = [0.0] * len(urls)

    def loads(self) -> list[ReplicaLoad]:
        now = time.monotonic()
        return [ReplicaLoad(n, 0, 0.0, healthy=now >= down)
                for n, down in zip(self.in_flight, self.down_until)]


class _Upstream(Exception):
    """An instance's answer to relay as it is (``response``) or a failure to answer for."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class PDProxy:
    """Routes each generation request through a prefill instance, then a decode instance."""

    def __init__(self, config: ProxyConfig, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.pools = {"prefill": _Pool("prefill", config.prefill),
                      "decode": _Pool("decode", config.decode)}
        self.router = DisaggregatedRouter.of(len(config.prefill), len(config.decode), 16)
        timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
        self.client = client if client is not None else httpx.AsyncClient(timeout=timeout)
        self._ids = itertools.count()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    async def generate(self, path: str, body: dict[str, Any]) -> Response:
        if body.get("kv_transfer_params") is not None:
            return error_response(400, "kv_transfer_params: the proxy sets them itself.",
                                  "kv_transfer_params")
        # the routers read the pools' loads, not the request: it is routed with a stand-in
        routed = EngineRequest(f"proxy-{next(self._ids)}", [0], SamplingParams(), 0.0)
        try:
            index = self._route("prefill", routed)
            params = await self._prefill(path, body, index)
            index = self._route("decode", routed, params)
            decode_body = {**body, "kv_transfer_params": params}
            if body.get("stream"):
                return await self._stream(path, decode_body, index)
            answer = await self._call("decode", index, path, decode_body)
        except _Upstream as exc:
            return exc.response
        return _relay(answer)

    def _route(self, pool: str, request: EngineRequest,
               params: dict[str, Any] | None = None) -> int:
        loads = self.pools[pool].loads()
        try:
            if pool == "prefill":
                return self.router.route_prefill(request, loads)
            return self.router.route_decode(request, params, loads)
        except NoHealthyReplica:
            raise _Upstream(error_response(503, f"No {pool} instance is reachable (each "
                                                "failed within the last "
                                                f"{self.config.retry_unhealthy_s:g} s).")) from None

    async def _prefill(self, path: str, body: dict[str, Any], index: int) -> dict[str, Any]:
        prefill_body = {k: v for k, v in body.items() if k != "stream_options"}
        prefill_body.update(max_tokens=1, stream=False,
                            kv_transfer_params=prefill_kv_transfer_params())
        if "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        answer = await self._call("prefill", index, path, prefill_body)
        if answer.status_code != 200:
            raise _Upstream(_relay(answer))
        url = self.pools["prefill"].urls[index]
        try:
            params = answer.json().get("kv_transfer_params")
        except (json.JSONDecodeError, AttributeError):
            params = None
        if not isinstance(params, dict):
            raise _Upstream(error_response(502, f"The prefill instance {url} answered without "
                                                "kv_transfer_params: is it started with "
                                                "--kv-transfer-config '{\"kv_role\": "
                                                "\"kv_producer\"}'?"))
        return params

    async def _call(self, pool: str, index: int, path: str,
                    body: dict[str, Any]) -> httpx.Response:
        side = self.pools[pool]
        side.in_flight[index] += 1
        try:
            return await self.client.post(side.urls[index] + path, json=body,
                                          headers=self.headers)
        except httpx.HTTPError as exc:
            raise _Upstream(self._failure(side, index, exc)) from None
        finally:
            side.in_flight[index] -= 1

    async def _stream(self, path: str, body: dict[str, Any], index: int) -> Response:
        side = self.pools["decode"]
        url = side.urls[index]
        side.in_flight[index] += 1
        try:
            request = self.client.build_request("POST", url + path, json=body,
                                                headers=self.headers)
            answer = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            side.in_flight[index] -= 1
            raise _Upstream(self._failure(side, index, exc)) from None
        if answer.status_code != 200:
            await answer.aread()
            await answer.aclose()
            side.in_flight[index] -= 1
            return _relay(answer)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_bytes():
                    yield chunk
            except httpx.HTTPError as exc:
                yield error_event(502, f"The decode instance {url} broke off the stream: "
                                       f"{type(exc).__name__}: {exc}").encode()
            finally:
                await answer.aclose()
                side.in_flight[index] -= 1
        return StreamingResponse(chunks(), media_type="text/event-stream")

    def _failure(self, side: _Pool, index: int, exc: httpx.HTTPError) -> Response:
        url = side.urls[index]
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            side.down_until[index] = time.monotonic() + self.config.retry_unhealthy_s
            return error_response(503, f"The {side.name} instance {url} is unreachable: {exc}")
        if isinstance(exc, httpx.TimeoutException):
            return error_response(504, f"The {side.name} instance {url} did not answer within "
                                       f"{self.config.timeout_s:g} s.")
        return error_response(502, f"The {side.name} instance {url} failed to answer: "
                                   f"{type(exc).__name__}: {exc}")

    async def health(self) -> JSONResponse:
        rows = []
        for side in self.pools.values():
            for url in side.urls:
                try:
                    status = (await self.client.get(url + "/health", timeout=5.0)).status_code
                    state = "ready" if status == 200 else f"answered {status}"
                except httpx.HTTPError as exc:
                    state = f"unreachable ({type(exc).__name__})"
                rows.append({"pool": side.name, "url": url, "state": state})
        ok = all(row["state"] == "ready" for row in rows)
        return JSONResponse({"status": "ok" if ok else "degraded", "instances": rows},
                            status_code=200 if ok else 503)

    async def models(self) -> Response:
        side = self.pools["decode"]
        try:
            answer = await self.client.get(side.urls[0] + "/v1/models", headers=self.headers)
        except httpx.HTTPError as exc:
            return self._failure(side, 0, exc)
        return _relay(answer)

    async def close(self) -> None:
        await self.client.aclose()


def _relay(answer: httpx.Response) -> Response:
    """An instance's answer as it is; one that is not JSON is wrapped in OpenAI's shape."""
    try:
        json.loads(answer.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_response(502 if answer.status_code < 400 else answer.status_code,
                              f"An instance answered {answer.status_code} with a body that "
                              f"is not JSON: {answer.text[:200]!r}")
    return Response(answer.content, answer.status_code, media_type="application/json")


def build_proxy_app(proxy: PDProxy) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.close()
    app = FastAPI(title="twinserve pd-proxy", lifespan=lifespan)

    async def generation(request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "The request body is not valid JSON.")
        if not isinstance(body, dict):
            return error_response(400, "The request body must be a JSON object.")
        return await proxy.generate(request.url.path, body)
    for path in GENERATION_PATHS:
        app.add_api_route(path, generation, methods=["POST"])
    app.add_api_route("/health", proxy.health, methods=["GET"])
    app.add_api_route("/v1/models", proxy.models, methods=["GET"])
    # (the last added runs first: the key is checked before the body is read)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=proxy.config.max_request_body_bytes,
                       read_timeout_s=proxy.config.body_read_timeout_s)
    if proxy.config.api_key:
        app.add_middleware(APIKeyMiddleware, api_keys={proxy.config.api_key: "key1"})
    return app


def add_proxy_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="base URLs of the prefill instances (serve --kv-transfer-config "
                             "'{\"kv_role\": \"kv_producer\"}')")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="base URLs of the decode instances (kv_role kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require Authorization: Bearer KEY from clients, and send it to the "
                             "instances")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="longest wait for one instance's answer (default 600)")
    parser.add_argument("--max-request-body-bytes", type=int,
                        default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="N",
                        help="413 for a request body over N bytes (default 1 MiB, as serve)")
    return parser


def run_proxy(args: argparse.Namespace) -> None:
    import uvicorn
    config = ProxyConfig(tuple(args.prefill), tuple(args.decode), args.api_key, args.timeout,
                         max_request_body_bytes=args.max_request_body_bytes)
    app = build_proxy_app(PDProxy(config))
    print(f"twinserve pd-proxy: http://{args.host}:{args.port} -> prefill "
          f"{', '.join(config.prefill)}; decode {', '.join(config.decode)}", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=5)


def main(argv: list[str] | None = None) -> None:
    parser = add_proxy_args(argparse.ArgumentParser(
        prog="twinserve pd-proxy", description="A prefill/decode proxy over separately "
        "started instances (vLLM's disaggregated-serving proxy)."))
    try:
        run_proxy(parser.parse_args(argv))
    except ValueError as exc:
        print(f"twinserve pd-proxy: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
