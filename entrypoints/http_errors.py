"""HTTP errors in OpenAI's shape and the ASGI middleware in front of the routes (API key, body
size limit)."""

from __future__ import annotations

import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from twinserve.entrypoints.async_engine import EngineDeadError
from twinserve.entrypoints.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("twinserve.server")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError",
               499: "ClientClosedRequest", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "Error"),
                                         param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def error_event(status: int, message: str, param: str | None = None) -> str:
    body = ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "Error"),
                                         param=param, code=status))
    return f"data: {body.model_dump_json()}\n\n"


def value_error_param(exc: ValueError, fields: set[str]) -> str | None:
    """The request field a ``ValueError`` message starts with (SamplingParams names it first)."""
    first = str(exc).split(" ", 1)[0].rstrip(":,.")
    return first if first in fields else None


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if not errors:
        return error_response(400, "Invalid request body.")
    first = errors[0]
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
        return error_response(exc.status, exc.message, exc.param)

    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc)

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(exc.status_code, str(exc.detail))

    async def on_dead(_: Request, exc: Exception) -> Response:
        return error_response(503, f"The engine is not running: {exc}")

    async def on_internal(_: Request, exc: Exception) -> Response:
        logger.exception("internal error", exc_info=exc)
        return error_response(500, "Internal server error.")

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(EngineDeadError, on_dead)
    app.add_exception_handler(Exception, on_internal)


# ==== middleware (pure ASGI, so streaming and disconnects pass through untouched) ================
class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` matches (open paths excepted)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not secrets.compare_digest(given, self.expected):
            response = error_response(401, "Unauthorized: a valid API key is required "
                                           "(Authorization: Bearer <key>).")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a body over ``max_bytes`` (by Content-Length, and by the bytes that arrive).

    The body is read here in full (it is small by construction) and replayed to the app; later
    ``receive`` calls go to the server, so the app still hears ``http.disconnect``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._too_large(scope, receive, send)
            return
        body = await self._read_body(receive)
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


