"""HTTP errors in OpenAI's shape and the ASGI middleware in front of the routes (catch-all,
Host check, API key, body size limit and read timeout).

No request closes a healthy keep-alive connection: an unexpected exception is answered 500 here
(Starlette's own last-resort handler answers and then re-raises, and uvicorn then closes the
connection); only a body that can no longer be read in step (too large, too slow) closes it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import secrets
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from twinserve.entrypoints.openai.async_engine import EngineDeadError
from twinserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("twinserve.server")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               413: "RequestTooLargeError", 429: "RateLimitError", 499: "ClientClosedRequest",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error answered in OpenAI's shape with ``status`` (and extra response ``headers``)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def retry_after(seconds: float) -> dict[str, str]:
    """The ``Retry-After`` header: whole seconds, at least 1."""
    value = seconds if math.isfinite(seconds) else 1.0
    return {"Retry-After": str(max(1, math.ceil(value)))}


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def _encodable(text: str | None) -> str | None:
    """``text`` with anything UTF-8 cannot encode (a lone surrogate echoed from the client)
    escaped, so that an error message can always be sent."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _error_body(status: int, message: str, param: str | None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=_encodable(message) or "",
                                         type=ERROR_TYPES.get(status, "Error"),
                                         param=_encodable(param), code=status))


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, param).model_dump(), status_code=status,
                        headers=headers)


def error_event(status: int, message: str, param: str | None = None) -> str:
    return f"data: {_error_body(status, message, param).model_dump_json()}\n\n"


def value_error_param(exc: ValueError, fields: set[str]) -> str | None:
    """The request field a ``ValueError`` message starts with (SamplingParams names it first)."""
    first = str(exc).split(" ", 1)[0].rstrip(":,.")
    return first if first in fields else None


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if not errors:
        return error_response(400, "Invalid request body.")
    first = errors[0]
    if first.get("type") == "lone_surrogate":  # protocol.RequestModel names the field
        ctx = first.get("ctx") or {}
        return error_response(400, str(ctx.get("message", "Invalid text.")), ctx.get("param"))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return error_response(400, f"Malformed JSON body: {detail}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    parts = []
    for err in errors[:3]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return error_response(400, "Invalid request: " + "; ".join(parts), param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc)

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(exc.status_code, str(exc.detail))

    async def on_dead(_: Request, exc: Exception) -> Response:
        return error_response(503, f"The engine is not running: {exc}")

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(EngineDeadError, on_dead)
    # Anything else: CatchAllMiddleware (a handler for Exception would re-raise, closing the
    # connection).


# ==== middleware (pure ASGI, so streaming and disconnects pass through untouched) ================
class CatchAllMiddleware:
    """An unexpected exception becomes one logged traceback and a 500 in OpenAI's shape; the
    connection stays open. (If the response had started, it cannot be repaired: the server
    closes that connection, as it must.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.error("internal error in %s %s", scope.get("method"), scope.get("path"),
                         exc_info=exc)
            if not started:
                await error_response(500, "Internal server error.")(scope, receive, send)


def bound_host_names(host: str) -> frozenset[str]:
    """The Host names a server bound to ``host`` accepts by default: loopback names and the
    bound address itself."""
    names = {"localhost", "127.0.0.1", "::1", host.strip("[]").lower()}
    return frozenset(names)


def _host_name(header: bytes) -> str:
    """``Host`` without its port (``[::1]:8000`` -> ``::1``, ``example.com:80`` ->
    ``example.com``), lowercased."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostCheckMiddleware:
    """400 unless the ``Host`` header names one of ``allowed`` (or, with ``allow_ip_literals``,
    any IP address: a DNS-rebinding page always sends its own DNS name). Protects a server on
    loopback from web pages that rebind their name to 127.0.0.1."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str], allow_ip_literals: bool) -> None:
        self.app = app
        self.allowed = allowed
        self.allow_ip_literals = allow_ip_literals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"host")
        name = _host_name(header) if header is not None else ""
        if name in self.allowed or (self.allow_ip_literals and _is_ip_literal(name)):
            await self.app(scope, receive, send)
            return
        response = error_response(400, "Invalid Host header: this server accepts only "
                                       f"{', '.join(sorted(self.allowed))} (--allowed-hosts).",
                                  "Host")
        await response(scope, receive, send)
class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` matches one of ``api_keys`` (open paths
    excepted). ``api_keys`` maps each key to its name, which the request then carries as
    ``request.state.api_key_name`` (the tenant, with ``--tenant-from-api-key``)."""

    def __init__(self, app: ASGIApp, api_keys: Mapping[str, str]) -> None:
        self.app = app
        self.expected = [(f"Bearer {key}".encode(), name) for key, name in api_keys.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        name = None
        for expected, key_name in self.expected:  # every key compared: no early exit to time
            if secrets.compare_digest(given, expected):
                name = key_name
        if name is None:
            response = error_response(401, "Unauthorized: a valid API key is required "
                                           "(Authorization: Bearer <key>).")
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["api_key_name"] = name
        await self.app(scope, receive, send)


DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20
DEFAULT_BODY_READ_TIMEOUT_S = 30.0


class BodySizeLimitMiddleware:
    """413 for a body over ``max_bytes`` (by Content-Length, and by the bytes that arrive); 408
    for one not complete within ``read_timeout_s`` of the request's start (a client that never
    finishes sending would otherwise hold its connection forever).

    The body is read here in full (it is small by construction) and replayed to the app; later
    ``receive`` calls go to the server, so the app still hears ``http.disconnect``."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._too_large(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.read_timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            response = error_response(408, "Request body not received within "
                                           f"{self.read_timeout_s:g} s (--body-read-timeout-s).")
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        if body is None:
            await self._too_large(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> Message | None:
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message  # disconnected before the body was complete
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"Request body too large: the limit is {self.max_bytes} "
                                       "bytes (--max-request-body-bytes).")
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _replay(first: Message, receive: Receive) -> Receive:
    pending = [first]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay


