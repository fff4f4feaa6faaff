"""Phi-3 (``Phi3ForCausalLM``; Phi-3-mini/small-medium, Phi-3.5-mini, Phi-4-mini's layout): Llama's
layers with q/k/v stored as one ``self_attn.qkv_proj`` tensor and gate/up as one
``mlp.gate_up_proj`` (split into the engine's shards at load, so tensor parallelism splits each
part), an optional ``sliding_window``, and longrope ("su") RoPE scaling in the long-context models.
``partial_rotary_factor`` < 1 (Phi-4-mini) is refused by the config reader."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from twinserve.core.architectures import register
from twinserve.core.architectures.base import DenseDecoder, FamilyFields, LinearSpec

if TYPE_CHECKING:
    from twinserve.core.model_config import ModelConfig

FUSED = {"qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}


@register
@dataclass(frozen=True, slots=True)
class Phi3(DenseDecoder):
    names: ClassVar[tuple[str, ...]] = ("Phi3ForCausalLM",)
    model_type: ClassVar[str] = "phi3"
    default_max_position_embeddings: ClassVar[int] = 4096

    def read_fields(self, raw: Mapping[str, Any]) -> FamilyFields:
        return FamilyFields(sliding_window=raw.get("sliding_window"))

    def linears(self, config: ModelConfig) -> tuple[LinearSpec, ...]:
        return tuple(dataclasses.replace(spec, fused_hf_name=FUSED.get(spec.name))
                     for spec in DenseDecoder.linears(self, config))
