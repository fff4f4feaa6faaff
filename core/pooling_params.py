"""``PoolingParams``: what an embedding request asks of the engine (vLLM's embed task on a
decoder model: the last prompt token's final hidden state, L2-normalised)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PoolingParams:
    """``normalize``: L2-normalise the pooled state (vLLM's default for embeddings).
    ``dimensions``: only the model's own hidden size is accepted (no Matryoshka truncation),
    checked by the engine. ``truncate_prompt_tokens``: keep the last k prompt tokens."""

    normalize: bool = True
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}.")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
            if value < 1 and not (name == "truncate_prompt_tokens" and value == -1):
                raise ValueError(f"{name} must be at least 1, got {value}.")
