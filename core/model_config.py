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

from twinserve.core.architectures import DenseDecoder, architecture_name, get_architecture
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

DEFAULT_RMS_NORM_EPS = 1e-6
DEFAULT_DTYPE = "bfloat16"
DTYPE_BYTES: Mapping[str, int] = MappingProxyType({
    "bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
})
_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType({
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
    "float": "float32", "fp8": "float8_e4m3fn",
})
_SILU = ("silu", "swish")
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
    torch_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None  # None: the checkpoint's; always a canonical name after __init__

    def __post_init__(self) -> None:
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
        act = raw.get("hidden_act", "silu")
        if act not in _SILU:
            raise ValueError(f"config.json: hidden_act {act!r} is not implemented "
                             "(the engine's MLP is SiLU-gated).")
        rope_theta, rope_scaling = rope(raw)
        family = entry.read_fields(raw)
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
        (it implements full attention only, so a shorter sliding window would be wrong)."""
        window = self.sliding_window
        if window is not None and window < max_model_len:
            raise ValueError(
                f"sliding-window attention is not implemented: sliding_window={window} < "
                f"max_model_len={max_model_len}; pass max_model_len <= {window}.")

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
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for one token over all layers."""
        return self.arch.kv_elements_per_token(self) * self.dtype_bytes

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
