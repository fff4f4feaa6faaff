"""The model's shape, read from an HF ``config.json`` (transformers 4.x and 5.x spellings)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinserve.core.hf_config import HFModelShape, read_hf_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_DEFAULT_MAX_POSITIONS = 2048


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """A Llama-family decoder. ``attention_bias`` is true for Qwen2 (q/k/v carry a bias)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"config.json: unknown architecture {self.architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}.")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}.")
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}.")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        shape = HFModelShape.from_dict(raw)
        if shape.architecture is None:
            raise ValueError("config.json: field 'architectures' is missing or empty.")
        return cls(
            architecture=shape.architecture,
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_hidden_layers,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_key_value_heads,
            head_dim=shape.head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=shape.rope_theta,
            rope_scaling=shape.rope_scaling,
            max_position_embeddings=shape.max_position_embeddings or _DEFAULT_MAX_POSITIONS,
            tie_word_embeddings=shape.tie_word_embeddings,
            # The engine has no o_proj bias, so only the q/k/v one matters here.
            attention_bias=shape.qkv_bias,
            torch_dtype=shape.dtype,
            eos_token_ids=shape.eos_token_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        return cls.from_dict(read_hf_config(model_dir))
