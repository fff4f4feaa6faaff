"""Dequantization in torch operations, on whatever device the blocks live: the path of quantized
weights on CUDA (the C++ decoders are CPU code). Every format of ``formats.py``: GGUF Q8_0, Q4_0,
Q4_1, Q4_K and Q6_K from their byte layouts (as llama.cpp's ``dequantize_row_*`` lay them out),
int8 and fp8 e4m3 with row scales, and the GPTQ/AWQ U4 groups. ``reference_dequantize`` (the
``gguf`` package, on the CPU) is the plain version the tests compare with.
"""

from __future__ import annotations

import torch

from twinserve.gpu.quantization.formats import QuantFormat


def dequantize_rows(fmt: QuantFormat, data: torch.Tensor, in_features: int,
                    row_scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows, in_features]`` from ``data`` ``[rows, fmt.row_bytes(in_features)]`` uint8."""
    rows = data.shape[0]
    blocks = data.reshape(rows, in_features // fmt.values, fmt.block_bytes)
    decode = _DECODERS.get(fmt.name)
    if decode is not None:
        return decode(blocks).reshape(rows, in_features)
    if fmt.name == "int8":
        return data.view(torch.int8).float() * row_scale[:, None]
    if fmt.name == "fp8_e4m3":
        return data.view(torch.float8_e4m3fn).float() * row_scale[:, None]
    if fmt.fmt_id == 7:
        return _u4(blocks, fmt.values).reshape(rows, in_features)
    raise ValueError(f"no torch decoder for {fmt.name}")


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block, as fp32 ``[rows, blocks, 1]``."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: byte j holds value j (low nibble) and j + 16 (high)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[..., 2:].contiguous().view(torch.int8).float() * _half(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return (_nibbles32(blocks[..., 2:]).float() - 8.0) * _half(blocks, 0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _nibbles32(blocks[..., 4:]).float() * _half(blocks, 0) + _half(blocks, 2)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """256 values: fp16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128 nibble bytes;
    each 64 values take 32 bytes, low nibbles then high, with their own scale and min."""
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    s = blocks[..., 4:16].long()
    low = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    mins = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 32)
    q = torch.stack([qs & 0xF, qs >> 4], dim=-2).reshape(*blocks.shape[:-1], 8, 32)
    scale = (d * low.float()).unsqueeze(-1)
    offset = (dmin * mins.float()).unsqueeze(-1)
    return (q.float() * scale - offset).flatten(-2)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """256 values: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d; each
    half of 128 values takes 64 low bytes and 32 high bytes, each 16 values one scale."""
    ql = blocks[..., :128].reshape(*blocks.shape[:-1], 2, 2, 32).long()  # half, 32-byte run
    qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 1, 32).long()
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = _half(blocks, 208)
    # in each half: values 0-31 low nibbles of run 0, 32-63 of run 1, 64-95 high nibbles of
    # run 0, 96-127 of run 1; their two upper bits from qh bits 0-1, 2-3, 4-5, 6-7
    low = torch.stack([ql & 0xF, ql >> 4], dim=-3)  # [..., half, nibble, run, 32]
    shifts = torch.tensor([[0, 2], [4, 6]], device=blocks.device).view(2, 2, 1)
    high = (qh.unsqueeze(-3) >> shifts) & 3  # [..., half, nibble, run, 32]
    q = (low | (high << 4)) - 32
    q = q.reshape(*blocks.shape[:-1], 16, 16).float()
    return (q * (d * scales).unsqueeze(-1)).flatten(-2)


def _u4(blocks: torch.Tensor, group: int) -> torch.Tensor:
    head = blocks[..., :8].contiguous().view(torch.float32)  # d, m
    qs = blocks[..., 8:].reshape(*blocks.shape[:-1], group // 32, 16)
    q = _nibbles32(qs).reshape(*blocks.shape[:-1], group).float()
    return q * head[..., :1] + head[..., 1:]


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}
