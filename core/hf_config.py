"""Reading a Hugging Face ``config.json``: the file, and the fields whose spelling changed.

transformers 4.x writes ``rope_theta``/``rope_scaling`` (type key ``type`` or ``rope_type``) and
``torch_dtype``; 5.x nests the theta in ``rope_parameters`` and writes ``dtype``. The functions here
read either; ``twinserve.core.model_config.ModelConfig`` is built from them. Plain Python.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_ROPE_THETA = 10000.0
# rope_type -> the fields of rope_scaling it needs (the engine implements these, gpu/layers/rope.py)
ROPE_TYPES: Mapping[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "dynamic": ("factor",),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


def read_hf_config(path_or_dir: str | Path) -> dict[str, Any]:
    """The JSON object of a ``config.json`` file, or of the one inside a model directory."""
    path = Path(path_or_dir)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: not found; expected a config.json or a model directory holding one.")
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


def required(raw: Mapping[str, Any], name: str) -> Any:
    """``raw[name]``; a missing field raises a ValueError naming it."""
    if name not in raw:
        raise missing_field(name)
    return raw[name]


def check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}.")


def required_positive_int(raw: Mapping[str, Any], name: str) -> int:
    value = required(raw, name)
    check_positive_int(name, value)
    return int(value)


def rope(raw: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)``; scaling is ``None`` for plain RoPE, else carries a ``rope_type`` key.

    When both are present the legacy ``rope_scaling`` wins, as transformers 5.x reads it. A rope
    type the engine does not implement, or one that lacks a field it needs, is refused here (a
    ValueError naming it), not silently run as plain RoPE.
    """
    scaling = dict(raw.get("rope_scaling") or {})
    parameters = dict(raw.get("rope_parameters") or {})
    params = scaling or parameters
    theta = raw.get("rope_theta")
    for nested in (parameters, scaling):
        if theta is None:
            theta = nested.get("rope_theta")
    params.pop("rope_theta", None)
    theta = DEFAULT_ROPE_THETA if theta is None else float(theta)
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type == "su":  # Phi-3's early name of longrope
        rope_type = "longrope"
    # yarn and longrope read these from the top level of config.json (Phi-3), as HF does
    for key in ("original_max_position_embeddings", "max_position_embeddings"):
        if rope_type in ("yarn", "longrope") and key not in params and raw.get(key):
            params[key] = raw[key]
    if rope_type == "yarn" and "original_max_position_embeddings" not in params \
            and "max_position_embeddings" in params:
        params["original_max_position_embeddings"] = params["max_position_embeddings"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json: rope_scaling type {rope_type!r} is not implemented "
                         f"(supported: {', '.join(ROPE_TYPES)}).")
    for key in ROPE_TYPES[rope_type]:
        if key not in params:
            raise ValueError(
                f"config.json: rope_scaling of type {rope_type!r} lacks field {key!r}.")
    return theta, None if rope_type == "default" else {**params, "rope_type": rope_type}


def eos_ids(eos: object) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, list):
        return tuple(int(e) for e in eos)
    if isinstance(eos, int) and not isinstance(eos, bool):
        return (eos,)
    raise ValueError(
        f"config.json: eos_token_id must be an integer or a list of them, got {eos!r}.")


def checkpoint_dtype(raw: Mapping[str, Any]) -> str | None:
    """transformers 5.x writes ``dtype``, 4.x ``torch_dtype``."""
    value = raw.get("dtype") or raw.get("torch_dtype")
    return None if value is None else str(value)
