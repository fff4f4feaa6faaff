"""4-bit values packed eight to an int32 (GPTQ's and AWQ's checkpoints): value ``j`` of a word
at bits ``4j``, along rows or along columns."""

from __future__ import annotations

import torch

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int32 -> ``[8R, C]`` values 0..15 (row ``8r + j`` from word ``r``, nibble j)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    values = (words[:, None, :] >> SHIFTS[None, :, None]) & 0xF
    return values.reshape(packed.shape[0] * 8, packed.shape[1])


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int32 -> ``[R, 8C]`` values 0..15 (column ``8c + j`` from word ``c``)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    return ((words[:, :, None] >> SHIFTS[None, None, :]) & 0xF).reshape(packed.shape[0], -1)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_rows``."""
    v = (values.to(torch.int64) & 0xF).reshape(values.shape[0] // 8, 8, values.shape[1])
    return _to_int32((v << SHIFTS[None, :, None]).sum(dim=1))


def pack_cols(values: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_cols``."""
    v = (values.to(torch.int64) & 0xF).reshape(values.shape[0], values.shape[1] // 8, 8)
    return _to_int32((v << SHIFTS[None, None, :]).sum(dim=2))
