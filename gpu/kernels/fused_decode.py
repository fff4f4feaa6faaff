"""The fused decode step: a quantized dense Llama-family model's whole forward for a decode step
(every sequence one new token) in one C++ call (``csrc/fused_decode.cpp``), where the per-op path
runs ~20 torch ops per layer (at batch 1 their dispatch, not the products, took most of the step).

The per-op path (``model.py`` with ``quantization/quant_linear.py``) stays the plain reference: the
same kernels compute the products (fp32 or int8 activations, as ``quant_tensor`` chooses), and
``tests/gpu/test_fused_decode.py`` compares hidden states and greedy tokens. The fused step applies
only where it is valid; elsewhere ``unsupported_reason`` names why and the reference path runs:
CPU, fp32 activations and KV cache, one RoPE table, SiLU gated MLP, plain RMSNorm, no sliding
window, soft-capping, q/k norm, bias, MoE, LoRA or tensor parallelism, every projection one
quantized part. The engine argument ``fused_decode=False`` (``--no-fused-decode``) switches it
off.

Q4_0 and Q4_1 projections are also kept repacked into 8-row groups (``csrc/quant_packed.h``,
made once when the step is built; the int8 products stream that copy, the fp32-activation ones
and the per-op path the file's rows): ``fused_packed=False`` (``--no-fused-packed``) leaves them
unpacked (the reference the tests and the benchmark compare with). The activations' precision
is the engine's ``quant_activations``, as for the per-op path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twinserve.gpu.layers.attention_backend import AttentionMetadata
from twinserve.gpu.models.model import CausalLM, DecoderLayer
from twinserve.gpu.quantization import cpu_kernel
from twinserve.gpu.quantization.quant_linear import QuantizedLinearMethod, quant_state
from twinserve.gpu.quantization.quant_tensor import DIRECT_MAX_TOKENS, Q8_DOT_IDS

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(slots=True)
class FusedDecode:
    """The kernel's flattened arguments for one model: ``weights`` (10 per layer, then the final
    norm), ``formats`` (format id and group of each projection) and ``packed`` (each projection's
    8-row packed copy, or an empty tensor) as ``fused_decode.cpp`` documents them;
    ``int8_activations``: the model's ``kernels.quant_activations`` is ``int8``."""

    weights: list[torch.Tensor]
    formats: list[int]
    packed: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float
    int8_activations: bool

    @property
    def all_q8(self) -> bool:
        """Every projection has the integer product (Q8_0, Q4_0, Q4_1)."""
        return all(fmt in Q8_DOT_IDS for fmt in self.formats[::2])

    @classmethod
    def for_model(cls, model: CausalLM, pack: bool | None = None) -> FusedDecode:
        """``pack``: keep Q4_0/Q4_1 projections repacked (default: the model's
        ``kernels.fused_packed``)."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fused decode step does not apply: {reason}.")
        pack = model.kernels.fused_packed if pack is None else pack
        weights: list[torch.Tensor] = []
        formats: list[int] = []
        packed: list[torch.Tensor] = []
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            weights.append(layer.input_layernorm.data)
            for name in PROJECTIONS:
                if name == "gate_up_proj":
                    weights.append(layer.post_attention_layernorm.data)
                part = quant_state(getattr(layer, name)).parts[0][1]
                assert part.fmt is not None
                weights += [part.data, part.row_scale]
                formats += [part.fmt.fmt_id, part.group]
                packed.append(cpu_kernel.quant_pack(part.data, part.fmt.fmt_id, part.in_features)
                              if pack and part.fmt.fmt_id in cpu_kernel.PACKED_IDS
                              else part.data.new_empty(0, 0))
        weights.append(model.norm.data)
        first = model.layers[0]
        assert isinstance(first, DecoderLayer)
        return cls(weights, formats, packed, model.ropes[0].cos, model.ropes[0].sin, first.num_heads,
                   first.num_kv_heads, model.config.rms_norm_eps, first.scale,
                   model.kernels.int8_activations)

    def run(self, hidden: torch.Tensor, positions: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            meta: AttentionMetadata) -> torch.Tensor:
        """Final normed hidden states ``[T, hidden]``; writes this step's K/V."""
        return torch.ops.twinserve_quant.fused_decode_step(
            hidden.float().contiguous(), self.weights, self.formats, self.packed,
            [k for k, _ in kv_caches], [v for _, v in kv_caches], self.cos, self.sin,
            positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, self.num_heads,
            self.num_kv_heads, self.eps, self.scale, self.int8_activations)


def can_run(input_ids: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            meta: AttentionMetadata, fused: FusedDecode) -> bool:
    """A decode step the kernel serves: one token per sequence, an fp32 KV cache, and products
    the per-op path computes alike: with int8 activations and every projection Q8_0/Q4_0/Q4_1
    any token count (a decode step's per-op products take the integer GEMM too:
    ``quant_tensor.per_sequence_rows``), else up to ``DIRECT_MAX_TOKENS`` (above it the per-op
    path dequantizes into torch's GEMM)."""
    tokens = input_ids.shape[0]
    small = tokens <= DIRECT_MAX_TOKENS or (fused.all_q8 and fused.int8_activations)
    return (meta.max_query_len == 1 and small and meta.block_tables.shape[0] == tokens
            and kv_caches[0][0].dtype == torch.float32)


def unsupported_reason(model: CausalLM) -> str | None:
    """Why the fused step cannot serve ``model`` (None: it can)."""
    config = model.config
    arch = config.arch
    if not model.kernels.fused_decode:
        return "the engine argument fused_decode is off"
    if model.embed_tokens.device.type != "cpu" or model.embed_tokens.dtype != torch.float32:
        return "it runs on the CPU in float32 only"
    if not cpu_kernel.kernel_available():
        return "the C++ quantized kernel is not built"
    if (arch.norm_plus_one or arch.sandwich_norms or arch.qk_norm or arch.embed_scale
            or config.moe is not None or config.hidden_act != "silu"):
        return f"{config.architecture} layers are not plain Llama layers"
    if config.attn_logit_softcapping is not None or len(model.ropes) != 1:
        return "soft-capping or per-layer RoPE"
    if any(config.layer_window(i) is not None for i in range(config.num_hidden_layers)):
        return "sliding-window layers"
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        if layer.num_heads != config.num_attention_heads:
            return "tensor parallelism"
        for name in PROJECTIONS:
            linear = getattr(layer, name)
            if type(linear.quant_method) is not QuantizedLinearMethod:
                return "LoRA or dense projections"
            parts = quant_state(linear).parts
            if linear._parameters["bias"] is not None or len(parts) != 1 or parts[0][1].fmt is None:
                return "a projection with bias, mixed formats or dense rows"
    return None
