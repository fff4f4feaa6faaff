"""The twin's cost terms for mixtures of experts and sliding-window attention.

Experts. A step of T tokens routes each to k of E experts; it reads the weights of every expert at
least one token chose. With routing close to uniform (the load-balancing loss trains for it) the
expected number of distinct experts touched per layer is ``E * (1 - (1 - k / E) ** T)``: k for one
token, all E for a large batch. The step then streams the layers' dense weights (attention, norms,
router, shared expert) plus that many experts', and computes only the k chosen experts' products
per token (``linear_flops_per_token`` of the MoE entry already counts k, not E).

Sliding windows. A layer with window W reads at most W positions per decode and W + n per prefill
chunk of n tokens, and each new token attends to at most W positions; global layers read their
whole context. The KV bytes and attention FLOPs are split between the two kinds of layers by their
share of the layers. (The KV manager, shared with the engine, frees blocks outside the window when
every layer has one; with global layers every block is kept.)
"""

from __future__ import annotations

from dataclasses import dataclass

from twinserve.core.architectures.moe_base import MoEDecoder
from twinserve.core.model_config import ModelConfig
from twinserve.core.outputs import SchedulerOutput


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Distinct experts a layer runs for ``num_tokens`` tokens routed uniformly, ``top_k`` each."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """Weight bytes a step streams as a function of its token count (per GPU)."""

    dense_bytes: float  # every layer's non-expert weights, the final norm and the LM head
    expert_bytes: float  # one expert's weights summed over the layers
    num_experts: int
    top_k: int

    def step_bytes(self, num_tokens: int) -> float:
        touched = expected_experts_touched(self.num_experts, self.top_k, num_tokens)
        return self.dense_bytes + touched * self.expert_bytes


def expert_weights(model: ModelConfig, bytes_per_param: float,
                   tensor_parallel_size: int) -> ExpertWeights | None:
    """The MoE weight term of ``model`` (None for a dense model)."""
    arch, moe = model.arch, model.moe
    if moe is None or not isinstance(arch, MoEDecoder):
        return None
    layers, scale = model.num_hidden_layers, bytes_per_param / tensor_parallel_size
    dense = (layers * arch.dense_params_per_layer(model) + model.hidden_size
             + arch.embedding_params(model))
    return ExpertWeights(dense * scale, layers * arch.expert_params(model) * scale,
                         moe.num_experts, moe.num_experts_per_tok)


@dataclass(frozen=True, slots=True)
class WindowedAttention:
    """The share of layers attending within ``window`` positions, the rest globally."""

    window: int
    sliding_share: float

    def kv_read(self, out: SchedulerOutput, full_read: float) -> float:
        """KV positions read, from the full-attention count ``full_read``."""
        bounded = (out.num_decode_seqs * self.window + out.num_prefill_tokens
                   + out.num_prefill_seqs * self.window)
        sliding = bounded if bounded < full_read else full_read
        return (1.0 - self.sliding_share) * full_read + self.sliding_share * sliding

    def context_tokens(self, out: SchedulerOutput) -> float:
        """``sum_context_tokens`` with each new token's context capped at the window."""
        full = out.sum_context_tokens
        bounded = out.total_num_scheduled_tokens * self.window
        sliding = bounded if bounded < full else full
        return (1.0 - self.sliding_share) * full + self.sliding_share * sliding


def windowed_attention(model: ModelConfig) -> WindowedAttention | None:
    """The window term of ``model`` (None when no layer has a window)."""
    windows = [model.layer_window(i) for i in range(model.num_hidden_layers)]
    sliding = [w for w in windows if w is not None]
    if not sliding:
        return None
    return WindowedAttention(max(sliding), len(sliding) / len(windows))
