"""What an architecture entry names, and the dense decoder the registered families share.

An entry says how to read its family's ``config.json`` fields, which linear projections a decoder
layer has (their HF tensor names and shapes, and how they are fused into the engine's layers),
the weight-name map the loader follows, and the parameter / FLOP / byte formulas the simulator's
cost model uses. The engine builds and loads its layers from the same entry, so the two agree on a
model's size by construction. Plain Python: no torch.

The dense decoder (Llama, Mistral, Qwen2) per layer::

    input_layernorm -> qkv_proj = [q_proj; k_proj; v_proj] (QKV, fused) -> attention -> o_proj (row)
    post_attention_layernorm -> gate_up_proj = [gate_proj; up_proj] (merged column) -> SiLU-gate
                             -> down_proj (row)

plus ``model.embed_tokens``, a final ``model.norm`` and an ``lm_head`` that may be tied to the
embedding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from twinserve.core.model_config import ModelConfig

LinearKind = Literal["qkv", "merged_column", "row", "replicated"]
ShardId = str | int | None


@dataclass(frozen=True, slots=True)
class WeightShard:
    """One HF projection placed in a fused engine layer: ``hf_name`` is relative to the layer
    prefix and has no ``.weight``/``.bias`` suffix (``self_attn.q_proj``)."""

    hf_name: str
    shard_id: ShardId
    output_size: int


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """One engine linear layer of a decoder layer (``qkv_proj``) and the HF tensors it holds.
    ``fused_hf_name``: the checkpoint stores the shards already stacked in one tensor of that
    name (Phi-3's ``self_attn.qkv_proj``); the layer's loader splits it into its shards."""

    name: str
    kind: LinearKind
    input_size: int
    shards: tuple[WeightShard, ...]
    bias: bool
    fused_hf_name: str | None = None

    @property
    def output_size(self) -> int:
        return sum(shard.output_size for shard in self.shards)

    @property
    def weight_params(self) -> int:
        return self.input_size * self.output_size

    @property
    def num_params(self) -> int:
        return self.weight_params + (self.output_size if self.bias else 0)


@dataclass(frozen=True, slots=True)
class WeightTarget:
    """Where one HF tensor goes: the engine parameter, the shard within it, the HF shape."""

    param: str
    shard_id: ShardId
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class MoEFields:
    """A mixture-of-experts MLP (every decoder layer): ``num_experts`` SiLU-gated experts of
    ``moe_intermediate_size``, ``num_experts_per_tok`` chosen per token by a softmax router
    (their weights renormalised to sum 1 when ``norm_topk_prob``), plus, when
    ``shared_expert_intermediate_size`` > 0, a shared expert scaled by a sigmoid gate (Qwen2-MoE)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}.")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"config.json: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"the {self.num_experts} experts.")
        size = self.shared_expert_intermediate_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError("config.json: shared_expert_intermediate_size must be a non-negative "
                             f"integer, got {size!r}.")


@dataclass(frozen=True, slots=True)
class FamilyFields:
    """The fields a family reads its own way (e.g. Qwen2's q/k/v bias, Mistral's window, Gemma's
    soft-capping). ``rope`` (theta, scaling), when set, replaces the generic reading of
    ``rope_theta``/``rope_scaling``; ``local_rope_theta`` is the sliding layers' own theta (Gemma 3).
    ``layer_types`` names each layer ``sliding_attention`` or ``full_attention`` (None: every
    layer uses ``sliding_window`` when there is one)."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    hidden_act: str | None = None  # None: config.json's ``hidden_act`` (SiLU by default)
    query_pre_attn_scalar: float | None = None  # attention scale = its -1/2 power (Gemma)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope: tuple[float, dict[str, Any] | None] | None = None
    local_rope_theta: float | None = None
    moe: MoEFields | None = None


@dataclass(frozen=True, slots=True)
class DenseDecoder:
    """A dense Llama-style decoder. Families subclass it, set the class constants and override
    ``read_fields`` (and, for a different layer arrangement, ``linears`` and the formulas)."""

    names: ClassVar[tuple[str, ...]] = ()  # HF ``architectures`` values served
    model_type: ClassVar[str] = ""  # HF ``model_type``, used when ``architectures`` is absent
    default_max_position_embeddings: ClassVar[int] = 2048  # the HF config class's default
    norms: ClassVar[tuple[str, ...]] = ("input_layernorm", "post_attention_layernorm")
    # per-head RMSNorm on q and k before RoPE (Qwen3): engine parameters ``q_norm`` and
    # ``k_norm`` of a decoder layer, shape [head_dim], eps ``rms_norm_eps``
    qk_norm: ClassVar[bool] = False
    # Gemma: RMSNorm scales by (1 + weight); norms after attention and around the MLP too
    # (``norms`` then names four); the embedding is scaled by sqrt(hidden_size)
    norm_plus_one: ClassVar[bool] = False
    sandwich_norms: ClassVar[bool] = False
    embed_scale: ClassVar[bool] = False

    def read_fields(self, raw: Mapping[str, Any]) -> FamilyFields:
        """Biases and the sliding window from the family's own config fields."""
        return FamilyFields()

    # --- layers and weights ---------------------------------------------------------------------

    def linears(self, config: ModelConfig) -> tuple[LinearSpec, ...]:
        """A decoder layer's projections, in forward order."""
        h, inter = config.hidden_size, config.intermediate_size
        q, kv = config.q_size, config.kv_size
        return (
            LinearSpec("qkv_proj", "qkv", h, (WeightShard("self_attn.q_proj", "q", q),
                                              WeightShard("self_attn.k_proj", "k", kv),
                                              WeightShard("self_attn.v_proj", "v", kv)),
                       config.qkv_bias),
            LinearSpec("o_proj", "row", q, (WeightShard("self_attn.o_proj", None, h),),
                       config.o_proj_bias),
            LinearSpec("gate_up_proj", "merged_column", h, (WeightShard("mlp.gate_proj", 0, inter),
                                                            WeightShard("mlp.up_proj", 1, inter)),
                       config.mlp_bias),
            LinearSpec("down_proj", "row", inter, (WeightShard("mlp.down_proj", None, h),),
                       config.mlp_bias),
        )

    def weight_map(self, config: ModelConfig) -> dict[str, WeightTarget]:
        """HF tensor name -> engine parameter, shard and HF shape, for every tensor loaded."""
        h, vocab = config.hidden_size, config.vocab_size
        out = {"model.embed_tokens.weight": WeightTarget("embed_tokens", None, (vocab, h)),
               "model.norm.weight": WeightTarget("norm", None, (h,))}
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = WeightTarget("lm_head", None, (vocab, h))
        linears = self.linears(config)
        for i in range(config.num_hidden_layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            for norm in self.norms:
                out[f"{hf}{norm}.weight"] = WeightTarget(ours + norm, None, (h,))
            for spec in linears:  # weights, then biases (the order random_model draws them in)
                if spec.fused_hf_name is not None:
                    out[f"{hf}{spec.fused_hf_name}.weight"] = WeightTarget(
                        f"{ours}{spec.name}.weight", None, (spec.output_size, spec.input_size))
                    continue
                for shard in spec.shards:
                    out[f"{hf}{shard.hf_name}.weight"] = WeightTarget(
                        f"{ours}{spec.name}.weight", shard.shard_id,
                        (shard.output_size, spec.input_size))
            for spec in (s for s in linears if s.bias):
                if spec.fused_hf_name is not None:
                    out[f"{hf}{spec.fused_hf_name}.bias"] = WeightTarget(
                        f"{ours}{spec.name}.bias", None, (spec.output_size,))
                    continue
                for shard in spec.shards:
                    out[f"{hf}{shard.hf_name}.bias"] = WeightTarget(
                        f"{ours}{spec.name}.bias", shard.shard_id, (shard.output_size,))
        return out

    # --- sizes (the cost model's formulas) ------------------------------------------------------

    def params_per_layer(self, config: ModelConfig) -> int:
        """The projections (+ biases) and the norm weights of one decoder layer."""
        linears = sum(spec.num_params for spec in self.linears(config))
        return linears + len(self.norms) * config.hidden_size

    def embedding_params(self, config: ModelConfig) -> int:
        return config.vocab_size * config.hidden_size

    def num_params(self, config: ModelConfig) -> int:
        """Embeddings + layers + final norm + ``lm_head`` when untied (the loaded tensors)."""
        lm_head = 0 if config.tie_word_embeddings else self.embedding_params(config)
        layers = config.num_hidden_layers * self.params_per_layer(config)
        return self.embedding_params(config) + layers + config.hidden_size + lm_head

    def streamed_params(self, config: ModelConfig) -> int:
        """Parameters a forward pass reads in full: every layer, the final norm and the LM head
        (the embedding rows it gathers are negligible)."""
        return (config.num_hidden_layers * self.params_per_layer(config) + config.hidden_size
                + self.embedding_params(config))

    def linear_flops_per_token(self, config: ModelConfig) -> int:
        """Multiply-adds x 2 of every layer's projections for one token (biases not counted)."""
        matmul = sum(spec.weight_params for spec in self.linears(config))
        return 2 * config.num_hidden_layers * matmul

    def lm_head_flops_per_seq(self, config: ModelConfig) -> int:
        """The LM head on one sampled position."""
        return 2 * self.embedding_params(config)

    def attention_flops_per_context_token(self, config: ModelConfig) -> int:
        """Scores and weighted values of one new token against one context position, all layers."""
        return 4 * config.num_hidden_layers * config.q_size

    def kv_elements_per_token(self, config: ModelConfig, num_kv_heads: int | None = None) -> int:
        """K and V of one token over all layers (``num_kv_heads``: the heads one device holds)."""
        heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
        return 2 * config.num_hidden_layers * heads * config.head_dim

    def allreduce_elements_per_token(self, config: ModelConfig) -> int:
        """Tensor parallelism all-reduces the hidden state twice per layer (attention, MLP)."""
        return 2 * config.num_hidden_layers * config.hidden_size

    def activation_elements_per_token(self, config: ModelConfig,
                                      tensor_parallel_size: int) -> float:
        """Peak activations of one token in a forward: hidden states and residual, and the
        qkv and MLP products split over the group."""
        split = config.q_size + 2 * config.kv_size + 3 * config.intermediate_size
        return 2 * config.hidden_size + split / tensor_parallel_size
