"""What one trace request becomes on the wire (the request body) and what comes back (its record).

Bodies follow vLLM's ``benchmark_serving`` (``ignore_eos``, greedy, streaming with a usage chunk):

- ``/v1/completions``: the prompt is the list of token ids of ``TraceRequest.prompt_token_ids``, so the
  server sees exactly ``input_tokens`` tokens and the trace's prefix sharing;
- ``/v1/chat/completions``: a chat request cannot carry token ids, so the user message is the text
  ``"hi hi hi ..."`` of ``input_tokens`` words. That is approximate: most tokenizers make one token of
  each ``" hi"``, and the chat template adds a few; the record's ``input_tokens`` is the server's own
  count (``usage.prompt_tokens``). No prefix sharing is reproduced on this endpoint.

``user`` carries the tenant; ``priority`` (lower = served earlier) is sent only when asked, since
servers that do not know the field may refuse it.
"""

from __future__ import annotations

import math
from typing import Any

from twinserve.core.metrics import RequestRecord
from twinserve.entrypoints.cli.sse_client import StreamResult
from twinserve.traces import TraceRequest

NO_TOKEN_ERROR = "the stream ended before any chunk carrying text"


def is_chat_endpoint(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("/chat/completions")


def request_body(req: TraceRequest, *, endpoint: str, model: str, vocab_size: int,
                 send_priority: bool) -> dict[str, Any]:
    """The JSON body for ``req`` on ``endpoint`` (see the module docstring)."""
    body: dict[str, Any] = {"model": model}
    if is_chat_endpoint(endpoint):
        body["messages"] = [{"role": "user", "content": chat_prompt(req.input_tokens)}]
        body["max_completion_tokens"] = req.output_tokens
    else:
        body["prompt"] = req.prompt_token_ids(vocab_size)
        body["max_tokens"] = req.output_tokens
    body.update({"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                 "temperature": 0, "user": req.tenant})
    if send_priority:
        body["priority"] = req.priority
    return body


def chat_prompt(num_words: int) -> str:
    """``num_words`` words ``hi``: an approximate prompt of about as many tokens."""
    return " ".join(["hi"] * num_words)


def to_record(req: TraceRequest, result: StreamResult) -> RequestRecord:
    """The record of one request: client-side times (``first_scheduled_time`` unknown: nan), token
    counts from the usage chunk (else the number of token chunks, and the trace's prompt length)."""
    chunks = result.chunk_times
    error = result.error or ("" if chunks else NO_TOKEN_ERROR)
    usage = result.usage or {}
    return RequestRecord(
        request_id=req.request_id,
        arrival_time=result.sent_time,
        first_scheduled_time=math.nan,
        first_token_time=chunks[0] if chunks else math.nan,
        finish_time=chunks[-1] if chunks and not error else result.end_time,
        input_tokens=_count(usage.get("prompt_tokens"), req.input_tokens),
        output_tokens=_count(usage.get("completion_tokens"), len(chunks)),
        cached_tokens=_count(_cached_tokens(usage), 0),
        tenant=req.tenant,
        priority=req.priority,
        finish_reason=result.finish_reason,
        success=not error,
        error=error,
        itls=[b - a for a, b in zip(chunks, chunks[1:])],
    )


def _cached_tokens(usage: dict[str, Any]) -> Any:
    details = usage.get("prompt_tokens_details")
    return details.get("cached_tokens") if isinstance(details, dict) else None


def _count(value: Any, default: int) -> int:
    """A token count from the server if it is a usable integer, else ``default``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return default
    return value
