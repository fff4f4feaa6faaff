"""Mixtral (``MixtralForCausalLM``): Mistral's attention with a mixture of
``num_local_experts`` experts (``block_sparse_moe``; experts' ``w1`` gate, ``w3`` up, ``w2`` down),
top-``num_experts_per_tok`` weights always renormalised; an optional ``sliding_window``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from twinserve.core.architectures import register
from twinserve.core.architectures.base import FamilyFields
from twinserve.core.architectures.moe_base import MoEDecoder, read_moe


@register
@dataclass(frozen=True, slots=True)
class Mixtral(MoEDecoder):
    names: ClassVar[tuple[str, ...]] = ("MixtralForCausalLM",)
    model_type: ClassVar[str] = "mixtral"
    default_max_position_embeddings: ClassVar[int] = 4096 * 32
    moe_prefix: ClassVar[str] = "block_sparse_moe"
    expert_names: ClassVar[tuple[str, str, str]] = ("w1", "w3", "w2")

    def read_fields(self, raw: Mapping[str, Any]) -> FamilyFields:
        return FamilyFields(sliding_window=raw.get("sliding_window"),
                            moe=read_moe(raw, "num_local_experts", True, shared=False))
