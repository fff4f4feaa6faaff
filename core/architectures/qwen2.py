"""Qwen2 (``Qwen2ForCausalLM``, also Qwen2.5): biases on q/k/v (not o); ``sliding_window``
applies only when ``use_sliding_window`` is true (or ``layer_types`` names sliding layers), to the
layers from ``max_window_layers`` on (HF's default ``layer_types``)."""

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
        window, layer_types = qwen_sliding(raw)
        return FamilyFields(qkv_bias=True, sliding_window=window, layer_types=layer_types)


def qwen_sliding(raw: Mapping[str, Any]) -> tuple[int | None, tuple[str, ...] | None]:
    """Qwen's window and which layers use it: ``layer_types`` as written, else HF's default with
    ``use_sliding_window`` (layers from ``max_window_layers`` on slide)."""
    given = raw.get("layer_types")
    sliding = bool(raw.get("use_sliding_window")) or "sliding_attention" in (given or ())
    if not sliding:
        return None, None
    window = raw.get("sliding_window") or HF_DEFAULT_SLIDING_WINDOW
    if given:
        return window, tuple(given)
    first = int(raw.get("max_window_layers") or 0)
    n = int(raw.get("num_hidden_layers") or 0)
    return window, tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
