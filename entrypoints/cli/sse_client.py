"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

The server answers ``text/event-stream``: ``data: {json}`` lines, blank lines between events, and a
final ``data: [DONE]``. Every chunk that carries text (``choices[0].text`` for completions,
``choices[0].delta.content`` or ``.reasoning_content`` for chat) is a *token chunk*; its arrival time
is recorded. Chunks without text (chat's leading role chunk, a bare ``finish_reason`` chunk, the usage
chunk, text held back by the server's detokenizer) are not token chunks. A chunk may carry several
tokens: like vLLM's benchmark, the gaps are taken per chunk and the token count comes from the usage
chunk.

Nothing here raises for a bad answer: an HTTP error status (with the message of OpenAI's error shape),
a transport failure (refused, reset, timeout), a malformed ``data:`` line, an error event inside the
stream or a stream that ends before ``[DONE]`` all end up in :attr:`StreamResult.error`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

MAX_ERROR_CHARS = 500
DONE = "[DONE]"


class SSEError(ValueError):
    """A stream that does not follow the OpenAI streaming format."""


@dataclass(slots=True)
class StreamResult:
    """What one streamed request gave back; times come from the caller's clock (seconds)."""

    sent_time: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of every token chunk
    end_time: float = math.nan  # when the stream (or the attempt) ended
    usage: dict[str, Any] | None = None  # the last non-null ``usage`` seen
    finish_reason: str = ""
    done: bool = False  # ``data: [DONE]`` arrived
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], clock: Callable[[], float],
) -> StreamResult:
    """POSTs ``body`` to ``url`` and reads the event stream to its end (see the module docstring)."""
    result = StreamResult(sent_time=clock())
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = http_error_message(response.status_code, await response.aread())
            else:
                await _read_events(response, result, clock)
    except httpx.HTTPError as exc:  # refused, reset, timed out, truncated body, ...
        result.error = one_line(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    except SSEError as exc:
        result.error = one_line(f"malformed stream: {exc}")
    except Exception as exc:  # noqa: BLE001 - a benchmark records a failed request, never crashes
        result.error = one_line(f"unexpected {type(exc).__name__}: {exc}")
    result.end_time = clock()
    return result


async def _read_events(response: httpx.Response, result: StreamResult,
                       clock: Callable[[], float]) -> None:
    async for line in response.aiter_lines():
        now = clock()
        data = sse_data(line)
        if data is None:
            continue
        if data == DONE:
            result.done = True
            return
        _apply_chunk(parse_chunk(data), now, result)
    raise SSEError(f"the stream ended without 'data: {DONE}'")


def _apply_chunk(chunk: dict[str, Any], now: float, result: StreamResult) -> None:
    if "error" in chunk or chunk.get("object") == "error":
        raise SSEError(f"error event: {openai_error_message(chunk) or chunk}")
    if isinstance(chunk.get("usage"), dict):
        result.usage = chunk["usage"]
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return
    if choice_text(choices[0]):
        result.chunk_times.append(now)
    if choices[0].get("finish_reason"):
        result.finish_reason = str(choices[0]["finish_reason"])


def sse_data(line: str) -> str | None:
    """The payload of a ``data:`` line; ``None`` for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    data = line[5:]
    return (data[1:] if data.startswith(" ") else data).strip()


def parse_chunk(data: str) -> dict[str, Any]:
    """One ``data:`` payload as a JSON object, else :class:`SSEError`."""
    try:
        chunk = json.loads(data)
    except ValueError:
        raise SSEError(f"a data line is not JSON: {data[:80]!r}") from None
    if not isinstance(chunk, dict):
        raise SSEError(f"a data line is not a JSON object: {data[:80]!r}")
    return chunk


def choice_text(choice: dict[str, Any]) -> str:
    """The text a streamed choice carries: ``text`` (completions) or the delta's content (chat)."""
    text = choice.get("text")
    if text:
        return str(text)
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    return ""


def openai_error_message(payload: Any) -> str:
    """The message of an error body: OpenAI's ``{"error": {"message": ...}}``, vLLM's older
    ``{"object": "error", "message": ...}`` or FastAPI's ``{"detail": ...}``; "" if none."""
    if not isinstance(payload, dict):
        return ""
    err = payload.get("error")
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(err, str) and err:
        return err
    for key in ("message", "detail"):
        if payload.get(key):
            return str(payload[key])
    return ""


def http_error_message(status: int, body: bytes) -> str:
    """``HTTP <status>: <message>`` from an error response body (JSON or plain text)."""
    text = body.decode("utf-8", "replace")
    try:
        message = openai_error_message(json.loads(text))
    except ValueError:
        message = ""
    return one_line(f"HTTP {status}: {message or text.strip() or '(empty body)'}")


def one_line(text: str) -> str:
    """Whitespace collapsed to single spaces, cut to ``MAX_ERROR_CHARS`` (it goes into a CSV cell)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= MAX_ERROR_CHARS else flat[:MAX_ERROR_CHARS - 3] + "..."
