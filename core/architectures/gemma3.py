"""Gemma 3, text (``Gemma3ForCausalLM``, model type ``gemma3_text``): Gemma 2's layers without
attention soft-capping (and, by default, without final-logit capping), with a per-head (1 + w)
RMSNorm on q and k, five sliding-window layers to one global (``layer_types``), and two RoPE
thetas: the global layers' (``rope_theta``, with its ``rope_scaling``) and the sliding layers'
(``rope_local_base_freq``, plain). transformers 5.x writes both in ``rope_parameters`` keyed by
layer type. The multimodal ``Gemma3ForConditionalGeneration`` is not served (refused by name)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from twinserve.core.architectures import register
from twinserve.core.architectures.base import DenseDecoder, FamilyFields, WeightTarget
from twinserve.core.architectures.gemma2 import (
    SANDWICH_NORMS,
    alternating_layer_types,
    gemma_activation,
)
from twinserve.core.architectures.qwen3 import qk_norm_params, qk_norm_weights
from twinserve.core.hf_config import rope

if TYPE_CHECKING:
    from twinserve.core.model_config import ModelConfig

HF_DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_GLOBAL_THETA = 1_000_000.0
DEFAULT_LOCAL_THETA = 10_000.0


def gemma3_rope(raw: Mapping[str, Any]) -> tuple[tuple[float, dict[str, Any] | None], float]:
    """((global theta, global scaling), local theta) from either spelling."""
    nested = raw.get("rope_parameters") or {}
    if isinstance(nested.get("full_attention"), dict):
        full = {**raw, "rope_parameters": nested["full_attention"], "rope_scaling": None,
                "rope_theta": None}
        local = nested.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError("config.json: Gemma 3 sliding layers with rope_type "
                             f"{local.get('rope_type')!r} are not implemented (default only).")
        return rope(full), float(local.get("rope_theta", DEFAULT_LOCAL_THETA))
    theta, scaling = rope({**raw, "rope_theta": raw.get("rope_theta", DEFAULT_GLOBAL_THETA)})
    return (theta, scaling), float(raw.get("rope_local_base_freq", DEFAULT_LOCAL_THETA))


@register
@dataclass(frozen=True, slots=True)
class Gemma3(DenseDecoder):
    names: ClassVar[tuple[str, ...]] = ("Gemma3ForCausalLM",)
    model_type: ClassVar[str] = "gemma3_text"
    default_max_position_embeddings: ClassVar[int] = 131072
    norms: ClassVar[tuple[str, ...]] = SANDWICH_NORMS
    norm_plus_one: ClassVar[bool] = True
    sandwich_norms: ClassVar[bool] = True
    embed_scale: ClassVar[bool] = True
    qk_norm: ClassVar[bool] = True

    def read_fields(self, raw: Mapping[str, Any]) -> FamilyFields:
        if raw.get("use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention is not implemented "
                             "(Gemma 3 is served as a causal decoder).")
        attention_bias = bool(raw.get("attention_bias") or False)
        window = raw.get("sliding_window", HF_DEFAULT_SLIDING_WINDOW)
        every = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        global_rope, local_theta = gemma3_rope(raw)
        return FamilyFields(
            qkv_bias=attention_bias, o_proj_bias=attention_bias, sliding_window=window,
            layer_types=alternating_layer_types(raw, every) if window else None,
            hidden_act=gemma_activation(raw),
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            rope=global_rope, local_rope_theta=local_theta)

    def weight_map(self, config: ModelConfig) -> dict[str, WeightTarget]:
        return DenseDecoder.weight_map(self, config) | qk_norm_weights(config)

    def params_per_layer(self, config: ModelConfig) -> int:
        return DenseDecoder.params_per_layer(self, config) + qk_norm_params(config)
