"""Qwen3-MoE (``Qwen3MoeForCausalLM``; Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k
RMSNorm, no biases) with ``num_experts`` experts of ``moe_intermediate_size``, no shared expert;
``norm_topk_prob`` (true in the released models) renormalises the chosen experts' weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from twinserve.core.architectures import register
from twinserve.core.architectures.base import FamilyFields, WeightTarget
from twinserve.core.architectures.moe_base import MoEDecoder, read_moe
from twinserve.core.architectures.qwen2_moe import qwen_window
from twinserve.core.architectures.qwen3 import qk_norm_params, qk_norm_weights

if TYPE_CHECKING:
    from twinserve.core.model_config import ModelConfig


@register
@dataclass(frozen=True, slots=True)
class Qwen3Moe(MoEDecoder):
    names: ClassVar[tuple[str, ...]] = ("Qwen3MoeForCausalLM",)
    model_type: ClassVar[str] = "qwen3_moe"
    default_max_position_embeddings: ClassVar[int] = 32768
    qk_norm: ClassVar[bool] = True

    def read_fields(self, raw: Mapping[str, Any]) -> FamilyFields:
        attention_bias = bool(raw.get("attention_bias") or False)
        return FamilyFields(qkv_bias=attention_bias, o_proj_bias=attention_bias,
                            sliding_window=qwen_window(raw),
                            moe=read_moe(raw, "num_experts", None, shared=False))

    def weight_map(self, config: ModelConfig) -> dict[str, WeightTarget]:
        return MoEDecoder.weight_map(self, config) | qk_norm_weights(config)

    def dense_params_per_layer(self, config: ModelConfig) -> int:
        return MoEDecoder.dense_params_per_layer(self, config) + qk_norm_params(config)
