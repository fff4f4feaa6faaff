"""Qwen2-MoE (``Qwen2MoeForCausalLM``; Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v
biases) with ``num_experts`` experts of ``moe_intermediate_size`` and a shared expert of
``shared_expert_intermediate_size`` behind a sigmoid gate; ``norm_topk_prob`` (default false)
renormalises the chosen experts' weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from twinserve.core.architectures import register
from twinserve.core.architectures.base import FamilyFields
from twinserve.core.architectures.moe_base import MoEDecoder, read_moe


def qwen_window(raw: Mapping[str, Any]) -> int | None:
    """Qwen's sliding window applies only with ``use_sliding_window``."""
    if not raw.get("use_sliding_window"):
        return None
    return raw.get("sliding_window") or 4096


@register
@dataclass(frozen=True, slots=True)
class Qwen2Moe(MoEDecoder):
    names: ClassVar[tuple[str, ...]] = ("Qwen2MoeForCausalLM",)
    model_type: ClassVar[str] = "qwen2_moe"
    default_max_position_embeddings: ClassVar[int] = 32768

    def read_fields(self, raw: Mapping[str, Any]) -> FamilyFields:
        return FamilyFields(qkv_bias=bool(raw.get("qkv_bias", True)),
                            sliding_window=qwen_window(raw),
                            moe=read_moe(raw, "num_experts", None, shared=True))
