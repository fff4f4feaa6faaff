"""Llama (``LlamaForCausalLM``): ``attention_bias`` puts biases on q/k/v and o, ``mlp_bias`` on
gate/up/down; no sliding window."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from twinserve.core.architectures import register
from twinserve.core.architectures.base import DenseDecoder, FamilyFields


@register
@dataclass(frozen=True, slots=True)
class Llama(DenseDecoder):
    names: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)
    model_type: ClassVar[str] = "llama"
    default_max_position_embeddings: ClassVar[int] = 2048

    def read_fields(self, raw: Mapping[str, Any]) -> FamilyFields:
        attention_bias = bool(raw.get("attention_bias") or False)
        return FamilyFields(qkv_bias=attention_bias, o_proj_bias=attention_bias,
                            mlp_bias=bool(raw.get("mlp_bias") or False))
