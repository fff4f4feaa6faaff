"""Quantization settings, shared by the real engine and the twin: the ``quantization=`` methods
twinserve implements, the ``kv_cache_dtype`` choices, and the bytes per weight and per KV value
each implies (the twin's weight-bytes and KV-capacity terms; the real engine sizes its KV cache
with the same numbers).

Weight bytes per parameter of the projections (the embedding and LM head are counted apart:
int8/fp8 keep them in the model's dtype, as vLLM's fp8 does; GGUF and GPTQ/AWQ checkpoints hold
them as the file does; a GGUF's embedding is given in the file and taken as Q8_0 here):

    gguf   Q4_1 by default (the bundled file): 20 bytes / 32 weights = 0.625
    int8   1 byte + one fp32 scale per output row        (~1.0)
    fp8    1 byte (e4m3) + one fp32 scale per output row (~1.0)
    gptq   4 bits + fp16 scale and 4-bit zero per 128    (0.5 + 2.5/128 = 0.52)
    awq    as gptq
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

QUANTIZATION_METHODS = ("gguf", "int8", "fp8", "gptq", "awq")
CHECKPOINT_METHODS = ("gptq", "awq")  # named by the checkpoint's quantization_config
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

# Bytes per projection weight, and per embedding / LM-head weight (None: the model's dtype).
_WEIGHT_BYTES: Mapping[str, tuple[float, float | None]] = {
    "gguf": (20 / 32, 34 / 32), "int8": (1.0, None), "fp8": (1.0, None),
    "gptq": (0.5 + 2.5 / 128, None), "awq": (0.5 + 2.5 / 128, None),
}


def check_quantization(name: str | None, field: str = "quantization") -> None:
    """ValueError unless ``name`` is None or a method twinserve implements."""
    if name is not None and name not in QUANTIZATION_METHODS:
        raise ValueError(f"{field} {name!r} is not supported by twinserve; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)}.")


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not supported by twinserve; supported: "
                         f"{', '.join(KV_CACHE_DTYPES)} (auto = the model's dtype; fp8 = "
                         "e4m3 with a per-tensor scale).")


def kv_value_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes per cached K or V value."""
    check_kv_cache_dtype(kv_cache_dtype)
    return model_dtype_bytes if kv_cache_dtype == "auto" else 1


def weight_bytes_per_param(quantization: str | None, dtype_bytes: int) -> tuple[float, float]:
    """(projection, embedding) bytes per weight under ``quantization``."""
    check_quantization(quantization)
    if quantization is None:
        return float(dtype_bytes), float(dtype_bytes)
    proj, embed = _WEIGHT_BYTES[quantization]
    return proj, float(dtype_bytes) if embed is None else embed


def resolve_quantization(requested: str | None, model: str | None,
                         checkpoint_config: Mapping[str, Any] | None) -> str | None:
    """The method a model runs with: a ``.gguf`` file is ``gguf``; a checkpoint with a
    ``quantization_config`` its ``quant_method`` (gptq, awq); else ``requested`` (int8, fp8 or
    None). A request that contradicts the checkpoint is refused naming both."""
    check_quantization(requested)
    is_gguf = model is not None and str(model).lower().endswith(".gguf")
    declared = None
    if checkpoint_config is not None:
        declared = checkpoint_config.get("quant_method")
        if declared not in CHECKPOINT_METHODS:
            raise ValueError(f"config.json: quantization_config.quant_method {declared!r} is "
                             "not supported by twinserve; supported checkpoint formats: "
                             f"{', '.join(CHECKPOINT_METHODS)} (and quantization="
                             "int8/fp8 on an unquantized checkpoint).")
    found = "gguf" if is_gguf else declared
    if found is not None:
        if requested not in (None, found):
            raise ValueError(f"quantization={requested!r} does not match the model, which is "
                             f"{found!r}; leave quantization unset or set it to {found!r}.")
        return found
    if requested == "gguf":
        raise ValueError("quantization='gguf' needs a .gguf model file.")
    if requested in CHECKPOINT_METHODS:
        raise ValueError(f"quantization={requested!r} needs a checkpoint whose config.json has a "
                         f"quantization_config with quant_method {requested!r}; use int8 or fp8 "
                         "to quantize an unquantized checkpoint at load time.")
    return requested
