"""``quantization="fp8"``: weight-only float8 e4m3 (max 448) with one fp32 scale per output
channel, ``s = max|w_row| / 448``, quantized at load time from any checkpoint (vLLM's dynamic
fp8 keeps a per-tensor scale; per-channel loses less). The embedding and LM head stay in the
model's dtype."""

from __future__ import annotations

import torch

from twinserve.gpu.quantization.formats import F8
from twinserve.gpu.quantization.quant_tensor import QuantTensor

E4M3_MAX = 448.0


def quantize_fp8(weight: torch.Tensor) -> QuantTensor:
    """``[rows, in]`` float weight -> per-row scaled e4m3."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return QuantTensor(F8, q.view(torch.uint8).contiguous(), w.shape[1], scale.contiguous())
