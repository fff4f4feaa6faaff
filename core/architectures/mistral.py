"""Mistral (``MistralForCausalLM``): Llama's layers without biases, and a ``sliding_window``
(HF's default 4096 when the field is absent; ``null`` for full attention)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from twinserve.core.architectures import register
from twinserve.core.architectures.base import DenseDecoder, FamilyFields

HF_DEFAULT_SLIDING_WINDOW = 4096


@register
@dataclass(frozen=True, slots=True)
class Mistral(DenseDecoder):
    names: ClassVar[tuple[str, ...]] = ("MistralForCausalLM",)
    model_type: ClassVar[str] = "mistral"
    default_max_position_embeddings: ClassVar[int] = 4096 * 32

    def read_fields(self, raw: Mapping[str, Any]) -> FamilyFields:
        return FamilyFields(sliding_window=raw.get("sliding_window", HF_DEFAULT_SLIDING_WINDOW))
