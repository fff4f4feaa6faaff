"""One description of a model, read from a Hugging Face ``config.json``: the engine builds and loads
its layers from it, the simulator's cost model sizes its work from it.

Field names are HF's. The derived sizes (parameters, bytes, FLOPs) come from the model's
architecture entry (``twinserve.core.architectures``), so the real engine and the twin agree on
them by construction. Plain Python: no torch, no simpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from twinserve.core.architectures import (
    DenseDecoder,
    MoEFields,
    architecture_name,
    get_architecture,
)
from twinserve.core.hf_config import (
    DEFAULT_ROPE_THETA,
    ROPE_TYPES,
    check_positive_int,
    checkpoint_dtype,
    eos_ids,
    read_hf_config,
    required,
    required_positive_int,
    rope,
)
from twinserve.core.quantization import (
    check_kv_cache_dtype,
    check_quantization,
    kv_value_bytes,
    weight_bytes_per_param,
)

DEFAULT_RMS_NORM_EPS = 1e-6
DEFAULT_DTYPE = "bfloat16"
DTYPE_BYTES: Mapping[str, int] = MappingProxyType({
    "bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
})
_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType({
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
    "float": "float32", "fp8": "float8_e4m3fn",
})
# config.json activation -> the engine's (gpu/models/model.py implements these two)
ACTIVATIONS: Mapping[str, str] = MappingProxyType({
    "silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"})
LAYER_TYPES = ("full_attention", "sliding_attention")
_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim",
                        "max_position_embeddings")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """A decoder of a registered architecture. ``torch_dtype`` is the checkpoint's dtype (as
    written, ``None`` when absent); ``dtype`` the compute dtype, by default the checkpoint's
    (``bfloat16`` when it has none), which sizes weights and KV cache in bytes."""

    name: str
    architecture: str
    model_type: str | None = None
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # biases on q/k/v (Qwen2; Llama's ``attention_bias``)
    o_proj_bias: bool = False  # a bias on o (Llama's ``attention_bias``)
    mlp_bias: bool = False  # biases on gate/up/down (Llama's ``mlp_bias``)
    sliding_window: int | None = None  # attention window in tokens; None: full attention
    # per layer "sliding_attention" (window) or "full_attention"; None: all alike
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"  # the engine's name: silu or gelu_tanh
    query_pre_attn_scalar: float | None = None  # attention scale = its -1/2 power (Gemma)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the logits
    local_rope_theta: float | None = None  # the sliding layers' RoPE theta (Gemma 3)
    moe: MoEFields | None = None  # a mixture-of-experts MLP in every layer
    torch_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None  # None: the checkpoint's; always a canonical name after __init__
    # how the weights and the KV cache are stored (core/quantization.py): bytes per weight/value
    quantization: str | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}.")
        self._entry()  # an unknown architecture is refused here
        for name in _POSITIVE_INT_FIELDS:
            check_positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}.")
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}.")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"config.json: {name} must be a positive number, got {value!r}.")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in ROPE_TYPES or rope_type == "default":
                raise ValueError(f"config.json: rope_scaling type {rope_type!r} is not implemented "
                                 f"(supported: {', '.join(ROPE_TYPES)}).")
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)
        self._check_layer_types()
        if self.hidden_act not in ACTIVATIONS.values():
            raise ValueError(f"hidden_act {self.hidden_act!r} is not implemented "
                             f"(supported: {', '.join(ACTIVATIONS)}).")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value > 0):
                raise ValueError(f"config.json: {name} must be a positive number or null, "
                                 f"got {value!r}.")
        if self.torch_dtype is not None and not isinstance(self.torch_dtype, str):
            raise ValueError(
                f"config.json: torch_dtype must be a string, got {self.torch_dtype!r}.")
        if self.dtype is None:
            dtype = DEFAULT_DTYPE if self.torch_dtype is None else canonical_dtype(
                self.torch_dtype, "torch_dtype")
        else:
            dtype = canonical_dtype(self.dtype, "dtype")
        object.__setattr__(self, "dtype", dtype)

    # --- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any], name: str) -> ModelConfig:
        """Parse the dict of a ``config.json`` (transformers 4.x or 5.x spellings). A missing or
        bad field, or one the engine cannot honour (an unknown ``rope_scaling`` type, an
        activation other than SiLU), raises a ValueError naming it."""
        heads = required_positive_int(raw, "num_attention_heads")
        hidden = required_positive_int(raw, "hidden_size")
        for field_name in ("vocab_size", "intermediate_size", "num_hidden_layers"):
            required(raw, field_name)
        arch_name = architecture_name(raw)
        entry = _entry_for(arch_name)
        family = entry.read_fields(raw)
        act = family.hidden_act or raw.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"config.json: hidden_act {act!r} is not implemented "
                             f"(supported: {', '.join(ACTIVATIONS)}).")
        rotary = raw.get("partial_rotary_factor", (raw.get("rope_parameters") or {}).get(
            "partial_rotary_factor", 1.0))
        if rotary not in (None, 1, 1.0):
            raise ValueError(f"config.json: partial_rotary_factor={rotary} is not implemented "
                             "(RoPE on the whole head only).")
        rope_theta, rope_scaling = family.rope if family.rope is not None else rope(raw)
        layer_types = family.layer_types
        if layer_types is None and family.sliding_window is not None and raw.get("layer_types"):
            layer_types = tuple(raw["layer_types"])
        model_type = raw.get("model_type")
        eps = raw.get("rms_norm_eps")
        return cls(
            name=name,
            architecture=arch_name,
            model_type=None if model_type is None else str(model_type),
            vocab_size=required(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=required(raw, "intermediate_size"),
            num_hidden_layers=required(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            max_position_embeddings=(raw.get("max_position_embeddings")
                                     or entry.default_max_position_embeddings),
            rms_norm_eps=DEFAULT_RMS_NORM_EPS if eps is None else eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias,
            o_proj_bias=family.o_proj_bias,
            mlp_bias=family.mlp_bias,
            sliding_window=family.sliding_window,
            layer_types=layer_types,
            hidden_act=ACTIVATIONS[act],
            query_pre_attn_scalar=family.query_pre_attn_scalar,
            attn_logit_softcapping=family.attn_logit_softcapping,
            final_logit_softcapping=family.final_logit_softcapping,
            local_rope_theta=family.local_rope_theta,
            moe=family.moe,
            torch_dtype=checkpoint_dtype(raw),
            eos_token_ids=eos_ids(raw.get("eos_token_id")),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """A model directory (named after it) or a ``config.json`` file."""
        path = Path(path)
        if path.is_dir():
            name = path.name
        else:
            name = path.parent.name if path.name == "config.json" else path.stem
        return cls.from_hf_dict(read_hf_config(path), name or "model")

    def with_dtype(self, dtype: str) -> ModelConfig:
        """The same model computed in ``dtype`` (``bfloat16``, ``fp32``, ``torch.float16``...)."""
        return dataclasses.replace(self, dtype=canonical_dtype(dtype, "dtype"))

    # --- refusals -------------------------------------------------------------------------------

    def check_servable(self, max_model_len: int) -> None:
        """Raise ValueError when the engine cannot run this model at ``max_model_len`` tokens
        (every architecture and feature the config names is refused earlier, when it is read;
        nothing depends on the length now that sliding windows are implemented)."""
        check_positive_int("max_model_len", max_model_len)

    def _check_layer_types(self) -> None:
        types = self.layer_types
        if types is None:
            return
        if len(types) != self.num_hidden_layers:
            raise ValueError(f"config.json: layer_types has {len(types)} entries for "
                             f"{self.num_hidden_layers} layers.")
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"config.json: layer_types {unknown} are not implemented "
                             f"(supported: {', '.join(LAYER_TYPES)}).")

    # --- per layer ------------------------------------------------------------------------------

    def layer_window(self, layer: int) -> int | None:
        """The attention window of decoder layer ``layer`` (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """RoPE (theta, scaling) of layer ``layer``: Gemma 3's sliding layers have their own
        theta and no scaling."""
        if self.local_rope_theta is not None and self.layer_window(layer) is not None:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def kv_sliding_window(self) -> int | None:
        """The window every layer attends within (None when some layer sees everything): the
        KV manager frees blocks outside it."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        if None in windows:
            return None
        return max(w for w in windows if w is not None)

    # --- derived sizes --------------------------------------------------------------------------

    @property
    def arch(self) -> DenseDecoder:
        """The architecture entry: layers, weight-name map and size formulas."""
        return get_architecture(self.architecture)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype or DEFAULT_DTYPE]

    @property
    def params_per_layer(self) -> int:
        return self.arch.params_per_layer(self)

    @property
    def embedding_params(self) -> int:
        return self.arch.embedding_params(self)

    @property
    def num_params(self) -> int:
        """Embeddings + layers + final norm + ``lm_head`` when untied."""
        return self.arch.num_params(self)

    @property
    def weight_bytes(self) -> int:
        """The loaded tensors' bytes: projections at the quantization's bytes per weight, the
        embedding (and untied LM head) at its own."""
        proj, embed = weight_bytes_per_param(self.quantization, self.dtype_bytes)
        tables = self.embedding_params * (1 if self.tie_word_embeddings else 2)
        return int((self.num_params - tables) * proj + tables * embed)

    @property
    def weight_bytes_per_param(self) -> float:
        """Average bytes per parameter (the twin scales the weights a step streams by it)."""
        return self.weight_bytes / self.num_params

    @property
    def kv_value_bytes(self) -> int:
        """Bytes per cached K or V value (1 for an fp8 cache)."""
        return kv_value_bytes(self.kv_cache_dtype, self.dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for one token over all layers."""
        return self.arch.kv_elements_per_token(self) * self.kv_value_bytes

    def with_quantization(self, quantization: str | None, kv_cache_dtype: str) -> ModelConfig:
        """The same model with its weights and KV cache stored as given."""
        return dataclasses.replace(self, quantization=quantization, kv_cache_dtype=kv_cache_dtype)

    def _entry(self) -> DenseDecoder:
        return _entry_for(self.architecture)


def canonical_dtype(dtype: str, field_name: str = "dtype") -> str:
    """``torch.bfloat16``, ``bf16``, ``BFloat16`` -> ``bfloat16``; unknown ones raise ValueError."""
    if not isinstance(dtype, str):
        raise ValueError(f"{field_name} must be a dtype name, got {dtype!r}.")  # noqa: TRY004
    key = dtype.strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"{field_name} {dtype!r} is not supported; known: "
                         f"{', '.join([*DTYPE_BYTES, *_DTYPE_ALIASES])}.")
    return key


def _entry_for(architecture: str) -> DenseDecoder:
    try:
        return get_architecture(architecture)
    except ValueError as exc:
        raise ValueError(f"config.json (field 'architectures'): {exc}") from None
