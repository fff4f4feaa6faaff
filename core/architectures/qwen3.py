"""Qwen3 (``Qwen3ForCausalLM``, dense): Qwen2's layers without the q/k/v biases (``attention_bias``
puts biases on q/k/v and o, false in the released models) and with a per-head RMSNorm on q and
on k (``self_attn.q_norm`` / ``self_attn.k_norm``, weight [head_dim]) applied before RoPE;
``head_dim`` is given in config.json and may differ from hidden_size / num_attention_heads. The
sliding window is read as Qwen2's (only when ``use_sliding_window`` is true)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from twinserve.core.architectures import register
from twinserve.core.architectures.base import DenseDecoder, FamilyFields, WeightTarget
from twinserve.core.architectures.qwen2 import qwen_sliding

if TYPE_CHECKING:
    from twinserve.core.model_config import ModelConfig

QK_NORMS = (("self_attn.q_norm", "q_norm"), ("self_attn.k_norm", "k_norm"))  # HF name, ours


def qk_norm_weights(config: ModelConfig) -> dict[str, WeightTarget]:
    """The per-head q/k RMSNorm weights of every layer (Qwen3, Qwen3-MoE, Gemma 3)."""
    return {f"model.layers.{i}.{hf_name}.weight": WeightTarget(f"layers.{i}.{ours}", None,
                                                               (config.head_dim,))
            for i in range(config.num_hidden_layers) for hf_name, ours in QK_NORMS}


def qk_norm_params(config: ModelConfig) -> int:
    return len(QK_NORMS) * config.head_dim


@register
@dataclass(frozen=True, slots=True)
class Qwen3(DenseDecoder):
    names: ClassVar[tuple[str, ...]] = ("Qwen3ForCausalLM",)
    model_type: ClassVar[str] = "qwen3"
    default_max_position_embeddings: ClassVar[int] = 32768  # Qwen3Config's default
    qk_norm: ClassVar[bool] = True

    def read_fields(self, raw: Mapping[str, Any]) -> FamilyFields:
        attention_bias = bool(raw.get("attention_bias") or False)
        window, layer_types = qwen_sliding(raw)
        return FamilyFields(qkv_bias=attention_bias, o_proj_bias=attention_bias,
                            sliding_window=window, layer_types=layer_types)

    def weight_map(self, config: ModelConfig) -> dict[str, WeightTarget]:
        return DenseDecoder.weight_map(self, config) | qk_norm_weights(config)

    def params_per_layer(self, config: ModelConfig) -> int:
        return DenseDecoder.params_per_layer(self, config) + qk_norm_params(config)
