"""The shape of a model, as the cost model needs it: read from a Hugging Face ``config.json``.

Only dense Llama-family decoders are modelled (Llama, Mistral, Qwen2): per layer an attention block
(q/k/v/o projections, grouped-query KV heads) and a gated MLP (gate/up/down), two RMSNorms, plus the
token embedding, a final norm and an ``lm_head`` that may share the embedding matrix.

``load_model_spec`` accepts a path to a ``config.json``, a directory holding one, or the name of a
bundled config (``simulator/data/models/<name>.json``, case-insensitive, e.g. ``llama-3-8b``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from twinserve.core.hf_config import HFModelShape, missing_field, read_hf_config

_MODELS_DIR = Path(__file__).parent / "data" / "models"
_DTYPE_BYTES = MappingProxyType({
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4, "float": 4,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1,
})
# Other spellings users type for bundled configs.
_ALIASES = MappingProxyType({"mistral-7b": "mistral-7b-v0.1", "qwen2.5-7b-instruct": "qwen2.5-7b"})


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """Dimensions of a dense decoder. Derived sizes are properties (parameters, bytes)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype_bytes: int = 2
    qkv_bias: bool = False  # Qwen2: biases on q/k/v
    o_proj_bias: bool = False  # Llama ``attention_bias``: biases on q/k/v and o

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be a non-empty string.")
        for field_name in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                           "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings"):
            _check_positive_int(field_name, getattr(self, field_name))
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}).")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str,
                       dtype_bytes: int | None = None) -> ModelSpec:
        """Build from the dict of an HF ``config.json`` (Llama/Mistral/Qwen2 field names)."""
        shape = HFModelShape.from_dict(config)
        if shape.max_position_embeddings is None:
            raise missing_field("max_position_embeddings")
        return cls(
            name=name,
            num_layers=shape.num_hidden_layers,
            hidden_size=shape.hidden_size,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_key_value_heads,
            head_dim=shape.head_dim,
            intermediate_size=shape.intermediate_size,
            vocab_size=shape.vocab_size,
            tie_word_embeddings=shape.tie_word_embeddings,
            max_position_embeddings=shape.max_position_embeddings,
            dtype_bytes=dtype_bytes if dtype_bytes is not None else _dtype_bytes(shape.dtype),
            qkv_bias=shape.qkv_bias,
            o_proj_bias=shape.o_proj_bias,
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        """q/k/v/o projections (+ biases), gate/up/down MLP, two RMSNorm weights."""
        h = self.hidden_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attention += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            attention += h
        return attention + 3 * h * self.intermediate_size + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Embeddings + layers + final norm + ``lm_head`` when untied."""
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + self.num_layers * self.params_per_layer + self.hidden_size + lm_head

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for one token over all layers."""
        return 2 * self.num_layers * self.kv_size * self.dtype_bytes


def load_model_spec(name_or_path: str | Path, dtype_bytes: int | None = None) -> ModelSpec:
    """A ``config.json`` file, a directory holding one, or a bundled name (see ``bundled_model_names``).

    ``dtype_bytes`` overrides the config's ``torch_dtype`` (e.g. 4 to model an fp32 run).
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        config_path, name = path / "config.json", path.name
        if not config_path.is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json.")
    elif path.is_file():
        config_path = path
        name = path.parent.name if path.name == "config.json" else path.stem
    else:
        config_path = _bundled_path(str(name_or_path))
        name = config_path.stem
    return ModelSpec.from_hf_config(read_hf_config(config_path), name, dtype_bytes)


def bundled_model_names() -> list[str]:
    """Names of the configs shipped in ``simulator/data/models``."""
    return sorted(p.stem for p in _MODELS_DIR.glob("*.json"))


def _bundled_path(name: str) -> Path:
    key = _normalize_name(name)
    key = _ALIASES.get(key, key)
    path = _MODELS_DIR / f"{key}.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name!r}: not a config.json path or directory, and not a bundled "
                         f"model. Valid names: {', '.join(bundled_model_names())}.")
    return path


def _normalize_name(name: str) -> str:
    """``meta-llama/Meta-Llama-3-8B`` -> ``llama-3-8b``; ``Llama-2-7b-hf`` -> ``llama-2-7b``."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = key.removeprefix("meta-")
    return key.removesuffix("-hf")


def _dtype_bytes(dtype: str | None) -> int:
    spelled = dtype or "bfloat16"
    key = spelled.lower().removeprefix("torch.")
    if key not in _DTYPE_BYTES:
        raise ValueError(f"torch_dtype {spelled!r} is not supported; known: {', '.join(_DTYPE_BYTES)}.")
    return _DTYPE_BYTES[key]


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
