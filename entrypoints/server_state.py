"""``ServerState``: what one app's handlers share (the engine, the served name, the metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twinserve.entrypoints.async_engine import AsyncEngine
from twinserve.entrypoints.http_errors import APIError
from twinserve.entrypoints.server_metrics import ServerMetrics


@dataclass(slots=True)
class ServerState:
    async_engine: AsyncEngine
    model_name: str
    model_root: str | None
    max_model_len: int
    metrics: ServerMetrics

    @property
    def engine(self) -> Any:
        return self.async_engine.engine

    @property
    def tokenizer(self) -> Any:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "This model has no tokenizer: send prompts as token ids.")
        return tok
