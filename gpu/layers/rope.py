"""Rotary position embedding (HF ``rotate_half`` layout) from a precomputed cos/sin table.

The inverse frequencies follow HF transformers' rope init functions (``modeling_rope_utils``) for
rope types default, linear, llama3, yarn, dynamic and longrope; yarn and longrope also scale cos and
sin by an attention factor. Two of them depend in HF on the length of the sequence at hand:

- dynamic NTK recomputes its base only past ``max_position_embeddings``, a length the engine never
  serves (``max_model_len`` is capped there), so within it the frequencies are plain RoPE's;
- longrope uses ``short_factor`` while the sequence is within ``original_max_position_embeddings``
  and ``long_factor`` beyond: the table holds one set, chosen by ``max_positions``. The engine
  serves longrope within the original length only (``core.engine_config``: the default
  ``max_model_len`` is capped there, a longer one refused by name), where HF uses the short
  factors for every sequence, so it matches HF exactly; past it HF switches per forward pass by
  the sequence's length, which one table per engine (vLLM's long factors throughout) would not.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_parameters(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                    max_positions: int) -> tuple[torch.Tensor, float]:
    """HF's ``(inv_freq, attention_factor)``: float32 ``[head_dim // 2]`` and the cos/sin scale."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    if scaling is None:
        return inv_freq, 1.0
    rope_type = scaling.get("rope_type")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "dynamic":
        return inv_freq, 1.0  # within max_position_embeddings (see the module docstring)
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    if rope_type == "longrope":
        return _longrope(exponent, theta, scaling, max_positions)
    raise ValueError(f"config.json: unsupported rope_scaling rope_type {rope_type!r} "
                     "(supported: default, linear, llama3, dynamic, yarn, longrope).")


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: dict[str, Any] | None, max_positions: int = 0) -> torch.Tensor:
    """HF's ``inv_freq`` (float32, ``[head_dim // 2]``)."""
    return rope_parameters(head_dim, theta, scaling, max_positions)[0]


def _field(scaling: dict[str, Any], name: str) -> Any:
    try:
        return scaling[name]
    except KeyError:
        raise ValueError(f"config.json: {scaling.get('rope_type')} rope_scaling lacks field "
                         f"{name!r}.") from None


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(_field(scaling, "factor"))
    low = float(_field(scaling, "low_freq_factor"))
    high = float(_field(scaling, "high_freq_factor"))
    old_len = float(_field(scaling, "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023) as HF's ``_compute_yarn_parameters``: interpolated frequencies
    below the correction range, extrapolated above it, a linear ramp between."""
    original = float(_field(scaling, "original_max_position_embeddings"))
    factor = scaling.get("factor")
    if factor is None:
        factor = float(scaling.get("max_position_embeddings", original)) / original
    attention = scaling.get("attention_factor")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    factor = float(factor)
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _longrope(exponent: torch.Tensor, base: float, scaling: dict[str, Any],
              max_positions: int) -> tuple[torch.Tensor, float]:
    original = int(_field(scaling, "original_max_position_embeddings"))
    factor = scaling.get("factor")
    if factor is None:
        factor = float(scaling.get("max_position_embeddings", original)) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    name = "long_factor" if max_positions > original else "short_factor"
    ext = torch.tensor(_field(scaling, name), dtype=torch.float32)
    if ext.shape != exponent.shape:
        raise ValueError(f"config.json: longrope {name} has {ext.numel()} entries, the head "
                         f"needs {exponent.numel()} (head_dim / 2).")
    return 1.0 / (ext * base ** exponent), float(attention)


class RotaryEmbedding:
    """cos/sin for positions ``[0, max_positions)``, each ``[max_positions, head_dim // 2]``."""

    __slots__ = ("cos", "sin")

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        inv_freq, attention = rope_parameters(head_dim, theta, scaling, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        self.cos = (freqs.cos() * attention).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * attention).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim // 2]`` for ``positions[T]`` (once per step)."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[T, H, D]`` (several heads at once), HF ``rotate_half`` layout."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
