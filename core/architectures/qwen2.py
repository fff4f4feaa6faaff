"""Qwen2 (``Qwen2ForCausalLM``, also Qwen2.5): biases on q/k/v (not o); ``sliding_window``
applies only when ``use_sliding_window`` is true (or ``layer_types`` names sliding layers)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from twinserve.core.architectures import register
from twinserve.core.architectures.base import DenseDecoder, FamilyFields

HF_DEFAULT_SLIDING_WINDOW = 4096


@register
@dataclass(frozen=True, slots=True)
class Qwen2(DenseDecoder):
    names: ClassVar[tuple[str, ...]] = ("Qwen2ForCausalLM",)
    model_type: ClassVar[str] = "qwen2"
    default_max_position_embeddings: ClassVar[int] = 32768

    def read_fields(self, raw: Mapping[str, Any]) -> FamilyFields:
        sliding = bool(raw.get("use_sliding_window")) or "sliding_attention" in (
            raw.get("layer_types") or ())
        window = (raw.get("sliding_window") or HF_DEFAULT_SLIDING_WINDOW) if sliding else None
        return FamilyFields(qkv_bias=True, sliding_window=window)
