"""``CausalLM`` with quantized projections and (optionally) a quantized embedding / LM head.

The dense ``embed_tokens`` / ``lm_head`` parameters are kept as empty ``[0, hidden]`` tensors (their
dtype and device still describe the model to the code that asks) and the lookups and the LM-head
product go to ``QuantizedEmbedding``."""

from __future__ import annotations

import torch

from twinserve.core.kernel_settings import KernelSettings
from twinserve.core.model_config import ModelConfig
from twinserve.gpu.kernels import fused_decode
from twinserve.gpu.layers.attention_backend import AttentionMetadata
from twinserve.gpu.layers.linear import LinearBase
from twinserve.gpu.models.model import CausalLM, KVCache
from twinserve.gpu.quantization.embedding import QuantizedEmbedding
from twinserve.gpu.quantization.quant_linear import QuantizedLinearMethod, quant_state
from twinserve.gpu.quantization.quant_tensor import QuantTensor, per_sequence_rows


class QuantizedCausalLM(CausalLM):
    """Projections by ``QuantizedLinearMethod``; ``set_embedding`` / ``set_lm_head`` replace the
    dense tables (until then the dense ones serve, filled by the caller)."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device, kernels: KernelSettings) -> None:
        super().__init__(config, max_positions, dtype, device,
                         quant_method=QuantizedLinearMethod(kernels.int8_activations),
                         kernels=kernels)
        self.quant_embed: QuantizedEmbedding | None = None
        self.quant_head: QuantizedEmbedding | None = None
        # made at the first decode step (after loading and any LoRA wrapping); None: not valid
        self._fused: fused_decode.FusedDecode | None = None
        self._fused_checked = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """A decode step by the fused kernel where it applies, else the per-op path."""
        if meta.max_query_len != 1:
            return super().forward(input_ids, positions, kv_caches, meta)
        with per_sequence_rows():  # a decode step: int8 products at any batch size
            fused = self.fused_step()
            if fused is not None and fused_decode.can_run(input_ids, kv_caches, meta, fused):
                return fused.run(self.embed(input_ids), positions, kv_caches, meta)
            return super().forward(input_ids, positions, kv_caches, meta)

    def fused_step(self) -> fused_decode.FusedDecode | None:
        """The fused decode step for this model, or None where it does not apply
        (``fused_decode.unsupported_reason``)."""
        if not self._fused_checked:
            self._fused_checked = True
            if fused_decode.unsupported_reason(self) is None:
                self._fused = fused_decode.FusedDecode.for_model(self, self.kernels.fused_packed)
        return self._fused

    def set_embedding(self, weight: QuantTensor) -> None:
        weight = weight.to(self.embed_tokens.device)  # (read on the CPU; no copy there)
        self.quant_embed = QuantizedEmbedding(weight, self.embed_tokens.dtype,
                                      self.kernels.int8_activations)
        self.embed_tokens = _empty_like_table(self.embed_tokens)
        if self.lm_head is None:  # tied: one table
            self.quant_head = self.quant_embed

    def set_lm_head(self, weight: QuantTensor) -> None:
        weight = weight.to(self.embed_tokens.device)
        self.quant_head = QuantizedEmbedding(weight, self.embed_tokens.dtype,
                                      self.kernels.int8_activations)
        if self.lm_head is not None:
            self.lm_head = _empty_like_table(self.lm_head)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_embed is None:
            return super().embed(input_ids)
        return self.quant_embed.embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant_head is None:
            return super().compute_logits(hidden)
        with per_sequence_rows():  # one row per sequence (or prompt position)
            logits = self.quant_head.logits(hidden)
        cap = self.config.final_logit_softcapping  # Gemma 2
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def finish_linears(self) -> None:
        """Merges each projection's parts and puts their blocks on the model's device (they are
        read on the CPU; a CUDA model multiplies them there, ``QuantTensor.device_matmul``)."""
        device = self.embed_tokens.device
        for module in self.modules():
            if isinstance(module, LinearBase):
                QuantizedLinearMethod.finish(module)
                state = quant_state(module)
                state.parts = [(start, part.to(device)) for start, part in state.parts]


def _empty_like_table(table: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(table.new_empty(0, table.shape[1]), requires_grad=False)
