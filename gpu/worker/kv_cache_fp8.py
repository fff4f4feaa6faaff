"""``kv_cache_dtype="fp8"``: the paged KV cache holds float8 e4m3 (one byte per value, so the
same memory holds twice the tokens of bf16, four times fp32's), with one scale per tensor
(``k_scale``, ``v_scale``; 1.0 as vLLM's default without calibrated scales, e4m3's range being
±448).

Writes quantize ``k / k_scale`` into the cache. Reads (``attend``) gather the blocks this step's
block tables use, once per layer, widen them to the model's dtype and run the model's own
attention over that compact copy, its block tables renumbered in ``prepare`` (once per step);
the plain kernels and their plans are untouched. The extra pass costs in proportion to the live
context; the C++ decode kernel reading fp8 directly would save it."""

from __future__ import annotations

from dataclasses import replace

import torch

from twinserve.gpu.layers.attention_backend import AttentionBackend, AttentionMetadata
from twinserve.gpu.models.model import CausalLM

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


class Fp8KVBackend:
    """Wraps a model's ``AttentionBackend`` (same interface: ``write_kv_cache``, ``prepare``,
    ``attend``) for fp8 caches; ``dtype``: what attention computes in."""

    __slots__ = ("inner", "dtype", "k_scale", "v_scale", "_used", "_compact_meta", "_meta")

    def __init__(self, inner: AttentionBackend, dtype: torch.dtype, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        if k_scale <= 0 or v_scale <= 0:
            raise ValueError(f"k_scale and v_scale must be positive, got {k_scale}, {v_scale}.")
        self.inner, self.dtype = inner, dtype
        self.k_scale, self.v_scale = k_scale, v_scale
        self._used: torch.Tensor | None = None
        self._compact_meta: AttentionMetadata | None = None
        self._meta: AttentionMetadata | None = None

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # as bytes: torch's CPU index_copy_ has no float8 kernel
        self.inner.write_kv_cache(quantize_fp8(key, self.k_scale).view(torch.uint8),
                                  quantize_fp8(value, self.v_scale).view(torch.uint8),
                                  key_cache.view(torch.uint8), value_cache.view(torch.uint8),
                                  slot_mapping)

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Renumber the step's blocks ``0..U-1`` (``_used[i]``: the cache block of compact
        block ``i``) and let the inner backend plan over the renumbered tables."""
        used, compact = torch.unique(meta.block_tables.long(), return_inverse=True)
        self._used = used
        self._meta = meta
        self._compact_meta = replace(meta, block_tables=compact.to(meta.block_tables.dtype),
                                     plans={})
        self.inner.prepare(self._compact_meta, block_size)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        if meta is not self._meta or self._used is None or self._compact_meta is None:
            raise RuntimeError("Fp8KVBackend.attend before prepare for this step's metadata.")
        keys = dequantize_fp8(_gather(key_cache, self._used), self.k_scale, self.dtype)
        values = dequantize_fp8(_gather(value_cache, self._used), self.v_scale, self.dtype)
        return self.inner.attend(query, keys, values, self._compact_meta, scale, window, softcap)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8).index_select(0, blocks).view(FP8_DTYPE)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` as e4m3 (saturating at ±448 rather than overflowing to NaN)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    out = x.to(torch.float32)
    if scale != 1.0:
        out.mul_(scale)
    return out.to(dtype)


def use_fp8_kv_cache(model: CausalLM, dtype: torch.dtype, device: torch.device,
                     tensor_parallel: bool) -> torch.dtype:
    """Switch ``model``'s attention to an fp8 cache; the cache's dtype. Refused where the
    kernels would read the bytes as another dtype (CUDA's Triton kernels, the TP workers)."""
    if device.type != "cpu":
        raise ValueError("kv_cache_dtype='fp8' runs on the CPU backend only for now "
                         "(device='cpu').")
    if tensor_parallel:
        raise ValueError("kv_cache_dtype='fp8' with tensor_parallel_size > 1 is not "
                         "implemented.")
    model.backend = Fp8KVBackend(model.backend, dtype)  # type: ignore[assignment]  # same interface
    return FP8_DTYPE
