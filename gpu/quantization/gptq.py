"""GPTQ 4-bit checkpoints (AutoGPTQ / GPTQModel layout, ``quantization_config.quant_method =
"gptq"``): per projection ``qweight`` int32 ``[in / 8, out]`` (eight input rows per word),
``qzeros`` int32 ``[groups, out / 8]`` (zeros minus one in the default ``gptq`` checkpoint
format, as stored; ``gptq_v2`` stores them as they are), ``scales`` fp16 ``[groups, out]`` and
``g_idx`` ``[in]``. ``W[o, i] = scale[g, o] * (q[i, o] - zero[g, o])`` with ``g = i // group_size``.
Act-order checkpoints (``desc_act``, a permuted ``g_idx``) are refused."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from twinserve.gpu.quantization.formats import U4_GROUPS
from twinserve.gpu.quantization.int4_packing import pack_cols, pack_rows, unpack_cols, unpack_rows
from twinserve.gpu.quantization.quant_tensor import QuantTensor, pack_u4

Reader = Callable[[str], torch.Tensor]


def check_config(qc: Mapping[str, Any]) -> int:
    """The group size of a supported GPTQ config (ValueError naming the field otherwise)."""
    if qc.get("bits", 4) != 4:
        raise ValueError(f"quantization_config.bits={qc.get('bits')!r}: twinserve runs 4-bit "
                         "GPTQ only.")
    if qc.get("desc_act", False):
        raise ValueError("quantization_config.desc_act=true (GPTQ act-order) is not supported "
                         "by twinserve; use a checkpoint quantized without act-order.")
    group = qc.get("group_size", 128)
    if group not in U4_GROUPS:
        raise ValueError(f"quantization_config.group_size={group!r} is not supported; "
                         f"supported: {', '.join(map(str, U4_GROUPS))}.")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format={fmt!r} is not supported; "
                         "supported: gptq, gptq_v2.")
    return int(group)


def load_gptq(read: Reader, prefix: str, qc: Mapping[str, Any]) -> QuantTensor:
    """The projection ``prefix`` (e.g. ``model.layers.0.self_attn.q_proj``) as U4 blocks."""
    group = check_config(qc)
    q = unpack_rows(read(f"{prefix}.qweight"))  # [in, out]
    zeros = unpack_cols(read(f"{prefix}.qzeros"))  # [groups, out]
    if qc.get("checkpoint_format", "gptq") == "gptq":
        zeros = zeros + 1
    scales = read(f"{prefix}.scales").float()
    in_features = q.shape[0]
    if scales.shape != (in_features // group, q.shape[1]) or zeros.shape != scales.shape:
        raise ValueError(f"{prefix}: scales {tuple(scales.shape)} / qzeros do not fit "
                         f"qweight's [{in_features}, {q.shape[1]}] with group_size {group}.")
    g_idx = _g_idx(read, prefix)
    if g_idx is not None and not torch.equal(g_idx.long(),
                                             torch.arange(in_features) // group):
        raise ValueError(f"{prefix}.g_idx is permuted (act-order), which twinserve does not "
                         "support.")
    return pack_u4(q.t().contiguous(), scales.t(), zeros.t().float(), group)


def _g_idx(read: Reader, prefix: str) -> torch.Tensor | None:
    try:
        return read(f"{prefix}.g_idx")
    except KeyError:
        return None


def quantize_gptq(weight: torch.Tensor, group: int = 128) -> dict[str, torch.Tensor]:
    """A projection's GPTQ tensors (symmetric, zero 8, round-to-nearest: the layout, not GPTQ's
    error-correcting search), ``qweight``/``qzeros``/``scales``/``g_idx``; for tests."""
    w = weight.float().t()  # [in, out]
    in_features, out = w.shape
    grouped = w.reshape(in_features // group, group, out)
    scales = (grouped.abs().amax(dim=1) / 7.5).clamp_min(1e-8).half()  # [groups, out]
    q = torch.round(grouped / scales.float()[:, None, :] + 8).clamp_(0, 15).reshape(w.shape)
    zeros = torch.full((in_features // group, out), 8 - 1, dtype=torch.int64)
    return {"qweight": pack_rows(q), "qzeros": pack_cols(zeros), "scales": scales,
            "g_idx": (torch.arange(in_features) // group).to(torch.int32)}


def dequantize_gptq(tensors: Mapping[str, torch.Tensor], group: int = 128) -> torch.Tensor:
    """The fp32 ``[out, in]`` weight of GPTQ tensors (the formula, written plainly)."""
    q = unpack_rows(tensors["qweight"]).float()
    zeros = unpack_cols(tensors["qzeros"]).float() + 1
    scales = tensors["scales"].float()
    g = torch.arange(q.shape[0]) // group
    return (scales[g] * (q - zeros[g])).t().contiguous()
