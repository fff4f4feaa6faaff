"""Gemma 2 (``Gemma2ForCausalLM``): GeGLU MLP (``gelu_pytorch_tanh``), RMSNorm scaling by
(1 + weight), norms after attention and around the MLP (``pre_feedforward_layernorm``,
``post_feedforward_layernorm``), the embedding scaled by sqrt(hidden_size), attention scale
``query_pre_attn_scalar ** -0.5``, soft-capped attention scores (``attn_logit_softcapping``) and
final logits (``final_logit_softcapping``), and sliding-window layers alternating with global
ones (``layer_types``; HF's default: even layers slide). Tied embeddings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from twinserve.core.architectures import register
from twinserve.core.architectures.base import DenseDecoder, FamilyFields

SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")
HF_DEFAULT_SLIDING_WINDOW = 4096


def alternating_layer_types(raw: Mapping[str, Any], every: int) -> tuple[str, ...]:
    """``layer_types`` as written, else HF's default: every ``every``-th layer global."""
    given = raw.get("layer_types")
    if given:
        return tuple(given)
    n = int(raw.get("num_hidden_layers") or 0)
    return tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(n))


def gemma_activation(raw: Mapping[str, Any]) -> str:
    """Gemma names its activation ``hidden_activation`` (``hidden_act`` in older configs)."""
    return str(raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh")


@register
@dataclass(frozen=True, slots=True)
class Gemma2(DenseDecoder):
    names: ClassVar[tuple[str, ...]] = ("Gemma2ForCausalLM",)
    model_type: ClassVar[str] = "gemma2"
    default_max_position_embeddings: ClassVar[int] = 8192
    norms: ClassVar[tuple[str, ...]] = SANDWICH_NORMS
    norm_plus_one: ClassVar[bool] = True
    sandwich_norms: ClassVar[bool] = True
    embed_scale: ClassVar[bool] = True

    def read_fields(self, raw: Mapping[str, Any]) -> FamilyFields:
        attention_bias = bool(raw.get("attention_bias") or False)
        window = raw.get("sliding_window", HF_DEFAULT_SLIDING_WINDOW)
        return FamilyFields(
            qkv_bias=attention_bias, o_proj_bias=attention_bias, sliding_window=window,
            layer_types=alternating_layer_types(raw, 2) if window else None,
            hidden_act=gemma_activation(raw),
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256),
            attn_logit_softcapping=raw.get("attn_logit_softcapping", 50.0),
            final_logit_softcapping=raw.get("final_logit_softcapping", 30.0))
