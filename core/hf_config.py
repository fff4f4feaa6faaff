"""The model shape read from a Hugging Face ``config.json``, shared by the torch engine and the simulator.

Handles the transformers 4.x and 5.x spellings (``rope_scaling``/``rope_theta`` vs ``rope_parameters``,
``torch_dtype`` vs ``dtype``). Plain Python: no torch, no simpy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ROPE_THETA = 10000.0
_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim")


@dataclass(slots=True, frozen=True)
class HFModelShape:
    """Dimensions and flags of a dense Llama-family decoder, with HF's defaults applied.

    Fields one consumer treats as required and the other defaults (``architecture``, ``model_type``,
    ``max_position_embeddings``, ``dtype``) are ``None`` when absent.
    """

    architecture: str | None
    model_type: str | None
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    eos_token_ids: tuple[int, ...]
    dtype: str | None

    def __post_init__(self) -> None:
        for name in _POSITIVE_INT_FIELDS:
            _check_positive_int(name, getattr(self, name))
        if self.max_position_embeddings is not None:
            _check_positive_int("max_position_embeddings", self.max_position_embeddings)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> HFModelShape:
        """Parse the dict of a ``config.json``; a missing or bad field raises a ValueError naming it."""
        heads = _required_positive_int(raw, "num_attention_heads")
        hidden = _required_positive_int(raw, "hidden_size")
        architecture = (raw.get("architectures") or [None])[0]
        model_type = raw.get("model_type")
        attention_bias = bool(raw.get("attention_bias", False))
        rope_theta, rope_scaling = _rope(raw)
        return cls(
            architecture=architecture,
            model_type=None if model_type is None else str(model_type),
            vocab_size=_required(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(raw, "intermediate_size"),
            num_hidden_layers=_required(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            max_position_embeddings=raw.get("max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama's ``attention_bias`` adds them to q/k/v and o.
            qkv_bias=_is_qwen2(architecture, model_type) or attention_bias,
            o_proj_bias=attention_bias,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            dtype=_dtype(raw),
        )


def read_hf_config(path_or_dir: str | Path) -> dict[str, Any]:
    """The JSON object of a ``config.json`` file, or of the one inside a model directory."""
    path = Path(path_or_dir)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; expected a config.json or a model directory holding one.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object.")  # noqa: TRY004 (bad input, not a bad call)
    return data


def missing_field(name: str) -> ValueError:
    """The error for a required ``config.json`` field that is absent."""
    return ValueError(f"config.json: required field {name!r} is missing.")


def _required(raw: Mapping[str, Any], name: str) -> Any:
    if name not in raw:
        raise missing_field(name)
    return raw[name]


def _required_positive_int(raw: Mapping[str, Any], name: str) -> int:
    """Checked before ``__post_init__`` because ``head_dim`` is derived from it."""
    value = _required(raw, name)
    _check_positive_int(name, value)
    return value


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}.")


def _is_qwen2(architecture: str | None, model_type: object) -> bool:
    return architecture == "Qwen2ForCausalLM" or model_type == "qwen2"


def _rope(raw: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)``; scaling is ``None`` for plain RoPE, else carries a ``rope_type`` key.

    transformers 5.x nests ``rope_theta`` in ``rope_parameters``; 4.x has a top-level ``rope_theta``
    and ``rope_scaling`` whose type key may be the older ``type``.
    """
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    nested_theta = params.pop("rope_theta", DEFAULT_ROPE_THETA)
    theta = float(raw.get("rope_theta", nested_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return theta, None if rope_type == "default" else {**params, "rope_type": rope_type}


def _eos_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def _dtype(raw: Mapping[str, Any]) -> str | None:
    """transformers 5.x writes ``dtype``, 4.x ``torch_dtype``."""
    value = raw.get("dtype") or raw.get("torch_dtype")
    return None if value is None else str(value)
