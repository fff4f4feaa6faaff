"""``quantization="int8"``: weight-only, per-output-channel symmetric int8, quantized at load
time from any checkpoint: ``q = round(w / s)``, ``s = max|w_row| / 127``. The embedding and LM
head stay in the model's dtype."""

from __future__ import annotations

import torch

from twinserve.gpu.quantization.formats import I8
from twinserve.gpu.quantization.quant_tensor import QuantTensor


def quantize_int8(weight: torch.Tensor) -> QuantTensor:
    """``[rows, in]`` float weight -> per-row symmetric int8."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantTensor(I8, q.view(torch.uint8).contiguous(), w.shape[1], scale.contiguous())
