"""Errors the engine raises for a request it will not take now (as opposed to ``ValueError``,
for a request it can never take)."""

from __future__ import annotations


class EngineOverloaded(RuntimeError):
    """The waiting queue is at a bound (``reason``: ``max_waiting_requests`` or
    ``max_waiting_tokens``): try again after ``retry_after_s`` seconds. A server answers 503."""

    def __init__(self, message: str, reason: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
