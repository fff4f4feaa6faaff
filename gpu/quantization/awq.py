"""AWQ 4-bit checkpoints (AutoAWQ's GEMM layout, ``quantization_config.quant_method = "awq"``):
per projection ``qweight`` int32 ``[in, out / 8]`` and ``qzeros`` int32 ``[groups, out / 8]``,
eight output columns per word in AutoAWQ's interleaved order (nibble ``j`` holds column
``ORDER[j]`` of its eight), ``scales`` fp16 ``[groups, out]``.
``W[o, i] = scale[g, o] * (q[i, o] - zero[g, o])`` with ``g = i // group_size``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from twinserve.gpu.quantization.formats import U4_GROUPS
from twinserve.gpu.quantization.int4_packing import pack_cols, unpack_cols
from twinserve.gpu.quantization.quant_tensor import QuantTensor, pack_u4

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
Reader = Callable[[str], torch.Tensor]


def check_config(qc: Mapping[str, Any]) -> int:
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise ValueError(f"quantization_config.bits={bits!r}: twinserve runs 4-bit AWQ only.")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version={version!r} is not supported; "
                         "supported: gemm.")
    if not qc.get("zero_point", True):
        raise ValueError("quantization_config.zero_point=false is not supported by twinserve.")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if group not in U4_GROUPS:
        raise ValueError(f"quantization_config.group_size={group!r} is not supported; "
                         f"supported: {', '.join(map(str, U4_GROUPS))}.")
    return int(group)


def _columns(order: tuple[int, ...], width: int) -> torch.Tensor:
    return (torch.arange(0, width, 8)[:, None] + torch.tensor(order)[None, :]).reshape(-1)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int32 -> ``[R, 8C]`` values in natural column order."""
    values = unpack_cols(packed)
    return values[:, _columns(REVERSE_ORDER, values.shape[1])]


def load_awq(read: Reader, prefix: str, qc: Mapping[str, Any]) -> QuantTensor:
    group = check_config(qc)
    q = unpack_awq(read(f"{prefix}.qweight"))  # [in, out]
    zeros = unpack_awq(read(f"{prefix}.qzeros"))  # [groups, out]
    scales = read(f"{prefix}.scales").float()
    if scales.shape != (q.shape[0] // group, q.shape[1]) or zeros.shape != scales.shape:
        raise ValueError(f"{prefix}: scales {tuple(scales.shape)} / qzeros do not fit "
                         f"qweight's [{q.shape[0]}, {q.shape[1]}] with group_size {group}.")
    return pack_u4(q.t().contiguous(), scales.t(), zeros.t().float(), group)


def quantize_awq(weight: torch.Tensor, group: int = 128) -> dict[str, torch.Tensor]:
    """A projection's AWQ tensors (asymmetric min/max round-to-nearest: the layout, not AWQ's
    activation-aware scale search), for tests."""
    w = weight.float().t()  # [in, out]
    in_features, out = w.shape
    grouped = w.reshape(in_features // group, group, out)
    lo, hi = grouped.amin(dim=1), grouped.amax(dim=1)
    scales = ((hi - lo) / 15).clamp_min(1e-8).half()
    zeros = torch.round(-lo / scales.float()).clamp_(0, 15)
    q = torch.round(grouped / scales.float()[:, None, :] + zeros[:, None, :]).clamp_(0, 15)
    order = _columns(ORDER, out)
    return {"qweight": pack_cols(q.reshape(w.shape)[:, order]),
            "qzeros": pack_cols(zeros[:, order]), "scales": scales}


def dequantize_awq(tensors: Mapping[str, torch.Tensor], group: int = 128) -> torch.Tensor:
    q = unpack_awq(tensors["qweight"]).float()
    zeros = unpack_awq(tensors["qzeros"]).float()
    scales = tensors["scales"].float()
    g = torch.arange(q.shape[0]) // group
    return (scales[g] * (q - zeros[g])).t().contiguous()
