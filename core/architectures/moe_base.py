"""The mixture-of-experts decoder the MoE families share (Mixtral, Qwen2-MoE, Qwen3-MoE).

A layer's attention is the dense decoder's; its MLP is a router (``gate``, ``[E, hidden]``) that
picks ``num_experts_per_tok`` of ``num_experts`` SiLU-gated experts per token, plus, in Qwen2-MoE,
a shared expert whose output is scaled by ``sigmoid(shared_expert_gate(x))``::

    x -> router softmax -> top-k (renormalised when norm_topk_prob) -> sum_k w_k * expert_k(x)
      -> + sigmoid(shared_expert_gate(x)) * shared_expert(x)          (Qwen2-MoE only)

Engine parameters per layer: ``moe.router`` [E, hidden], ``moe.w13`` [E, 2 * inter, hidden]
(expert e's gate rows then its up rows: shard ``2 e`` and ``2 e + 1``), ``moe.w2``
[E, hidden, inter] (shard ``e``); the shared expert is the layer's ``shared_gate_up_proj`` /
``shared_down_proj`` and ``shared_expert_gate`` [1, hidden].

The size formulas count every expert's weights in a checkpoint (``num_params``) but only the
chosen experts' products per token (``linear_flops_per_token``); ``expert_params`` /
``dense_params_per_layer`` let the twin's cost model charge the experts a step touches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from twinserve.core.architectures.base import (
    DenseDecoder,
    LinearSpec,
    MoEFields,
    WeightShard,
    WeightTarget,
)

if TYPE_CHECKING:
    from twinserve.core.model_config import ModelConfig


def read_moe(raw: Mapping[str, Any], experts_field: str, norm_topk_prob: bool | None,
             shared: bool) -> MoEFields:
    """The MoE fields of a config.json (``experts_field``: ``num_local_experts`` in Mixtral,
    ``num_experts`` in Qwen); ``norm_topk_prob`` None: read from the config (default False).
    Layers without experts (``decoder_sparse_step`` > 1, ``mlp_only_layers``) are refused."""
    step = raw.get("decoder_sparse_step", 1)
    if step not in (None, 1) or raw.get("mlp_only_layers"):
        raise ValueError("config.json: dense MLP layers among the expert layers "
                         f"(decoder_sparse_step={step}, mlp_only_layers="
                         f"{raw.get('mlp_only_layers')}) are not implemented.")
    # transformers 5.x writes num_local_experts for every family
    experts_field = next((f for f in (experts_field, "num_local_experts") if f in raw), "")
    if not experts_field:
        raise ValueError("config.json: required field 'num_experts' (or 'num_local_experts') "
                         "is missing.")
    inter: int = raw.get("moe_intermediate_size") or raw.get("intermediate_size") or 0
    return MoEFields(
        num_experts=raw[experts_field], num_experts_per_tok=raw.get("num_experts_per_tok", 2),
        moe_intermediate_size=inter,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if norm_topk_prob is None
        else norm_topk_prob,
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
        if shared else 0)


@dataclass(frozen=True, slots=True)
class MoEDecoder(DenseDecoder):
    """Families set the HF names of the router and of an expert's three projections."""

    moe_prefix: ClassVar[str] = "mlp"  # HF: model.layers.i.<prefix>.gate / .experts.e.<name>
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    def moe(self, config: ModelConfig) -> MoEFields:
        if config.moe is None:
            raise ValueError(f"{config.architecture}: the config has no experts.")
        return config.moe

    def linears(self, config: ModelConfig) -> tuple[LinearSpec, ...]:
        """Attention's projections, and the shared expert's when there is one."""
        attention = DenseDecoder.linears(self, config)[:2]
        h, shared = config.hidden_size, self.moe(config).shared_expert_intermediate_size
        if not shared:
            return attention
        return (*attention,
                LinearSpec("shared_gate_up_proj", "merged_column", h, (
                    WeightShard("mlp.shared_expert.gate_proj", 0, shared),
                    WeightShard("mlp.shared_expert.up_proj", 1, shared)), False),
                LinearSpec("shared_down_proj", "row", shared,
                           (WeightShard("mlp.shared_expert.down_proj", None, h),), False))

    def weight_map(self, config: ModelConfig) -> dict[str, WeightTarget]:
        out = DenseDecoder.weight_map(self, config)
        moe, h = self.moe(config), config.hidden_size
        inter = moe.moe_intermediate_size
        gate, up, down = self.expert_names
        for i in range(config.num_hidden_layers):
            hf, ours = f"model.layers.{i}.{self.moe_prefix}.", f"layers.{i}."
            out[f"{hf}gate.weight"] = WeightTarget(f"{ours}moe.router", None,
                                                   (moe.num_experts, h))
            for e in range(moe.num_experts):
                expert = f"{hf}experts.{e}."
                out[f"{expert}{gate}.weight"] = WeightTarget(f"{ours}moe.w13", 2 * e, (inter, h))
                out[f"{expert}{up}.weight"] = WeightTarget(f"{ours}moe.w13", 2 * e + 1, (inter, h))
                out[f"{expert}{down}.weight"] = WeightTarget(f"{ours}moe.w2", e, (h, inter))
            if moe.shared_expert_intermediate_size:
                out[f"model.layers.{i}.mlp.shared_expert_gate.weight"] = WeightTarget(
                    f"{ours}shared_expert_gate", None, (1, h))
        return out

    # --- sizes ----------------------------------------------------------------------------------

    def expert_params(self, config: ModelConfig) -> int:
        """One expert's gate, up and down weights."""
        return 3 * config.hidden_size * self.moe(config).moe_intermediate_size

    def dense_params_per_layer(self, config: ModelConfig) -> int:
        """A layer's parameters but its routed experts': attention, norms, router, shared expert."""
        moe = self.moe(config)
        shared_gate = config.hidden_size if moe.shared_expert_intermediate_size else 0
        return (DenseDecoder.params_per_layer(self, config) + moe.num_experts * config.hidden_size
                + shared_gate)

    def params_per_layer(self, config: ModelConfig) -> int:
        return (self.dense_params_per_layer(config)
                + self.moe(config).num_experts * self.expert_params(config))

    def active_params_per_layer(self, config: ModelConfig, num_experts: float) -> float:
        """The weights a step reads in one layer when it touches ``num_experts`` experts."""
        return self.dense_params_per_layer(config) + num_experts * self.expert_params(config)

    def streamed_params(self, config: ModelConfig) -> int:
        """Every expert (a step large enough touches them all); the cost model narrows this to
        the experts a step touches (``active_params_per_layer``)."""
        return DenseDecoder.streamed_params(self, config)

    def linear_flops_per_token(self, config: ModelConfig) -> int:
        """Attention's and the shared expert's products, the router, and the ``k`` chosen
        experts (not all of them)."""
        moe = self.moe(config)
        dense = sum(spec.weight_params for spec in self.linears(config))
        router = moe.num_experts * config.hidden_size
        shared_gate = config.hidden_size if moe.shared_expert_intermediate_size else 0
        routed = moe.num_experts_per_tok * self.expert_params(config)
        return 2 * config.num_hidden_layers * (dense + router + shared_gate + routed)

    def activation_elements_per_token(self, config: ModelConfig,
                                      tensor_parallel_size: int) -> float:
        moe = self.moe(config)
        split = (config.q_size + 2 * config.kv_size
                 + 3 * moe.num_experts_per_tok * moe.moe_intermediate_size
                 + 3 * moe.shared_expert_intermediate_size)
        return 2 * config.hidden_size + moe.num_experts + split / tensor_parallel_size
