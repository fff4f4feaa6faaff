"""The Llama-family decoder (Llama, Mistral, Qwen2) over a flattened, unpadded batch.

One forward serves prefills, chunked prefills and decodes together: ``input_ids[T]`` and
``positions[T]`` concatenate every scheduled sequence's new tokens, ``AttentionMetadata`` says where
each sequence's rows are and where its KV lives. Weights are fused at load time: q/k/v into one
``qkv_proj`` and gate/up into one ``gate_up_proj`` (one matmul each instead of three and two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twinserve.gpu.attention_backend import AttentionBackend, AttentionMetadata
from twinserve.gpu.config import ModelConfig
from twinserve.gpu.cpu_gemm import Gemm
from twinserve.gpu.rope import RotaryEmbedding, apply_rope

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin for this step's positions


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, gemm: Gemm) -> None:
        super().__init__()
        self.gemm = gemm
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim ** -0.5
        qkv_out = config.q_size + 2 * config.kv_size
        self.input_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.qkv_proj = nn.Parameter(torch.empty(qkv_out, config.hidden_size))
        self.qkv_bias = nn.Parameter(torch.zeros(qkv_out)) if config.attention_bias else None
        self.o_proj = nn.Parameter(torch.empty(config.hidden_size, config.q_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.gate_up_proj = nn.Parameter(
            torch.empty(2 * config.intermediate_size, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(config.hidden_size, config.intermediate_size))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden if residual is None else residual + hidden
        x = rms_norm(residual, self.input_layernorm, self.eps)
        x = self._attention(x, rope, kv_cache, meta, backend)
        residual = residual + x
        x = rms_norm(residual, self.post_attention_layernorm, self.eps)
        return self._mlp(x), residual

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm.plain(x.shape[0]):
            gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, self.down_proj)
        gate_up = self.gemm.feature_major(x, self.gate_up_proj)  # [2 * intermediate, T]
        gate, up = gate_up.chunk(2, dim=0)
        return self.gemm.linear(F.silu(gate).mul_(up).t(), self.down_proj)

    def _attention(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache,
                   meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.gemm.linear(x, self.qkv_proj, self.qkv_bias)
        qkv = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, :self.num_heads + self.num_kv_heads], *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        key_cache, value_cache = kv_cache
        backend.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = backend.attend(q, key_cache, value_cache, meta, self.scale)
        return self.gemm.linear(out.reshape(num_tokens, -1), self.o_proj)


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and (possibly tied) LM head."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.gemm = Gemm.for_device(device, dtype)
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, self.gemm)
                                    for _ in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = (None if config.tie_word_embeddings else
                        nn.Parameter(torch.empty(config.vocab_size, config.hidden_size)))
        self.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                    config.rope_scaling, dtype, device)
        self.backend = AttentionBackend(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` (normed) for every scheduled token."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual = None
        rope = self.rope.lookup(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rope, kv_cache, meta, self.backend)
        return rms_norm(residual + hidden, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` for the rows that sample."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if self.gemm.plain(hidden.shape[0]):
            return F.linear(hidden, head).float()
        return self.gemm.feature_major(hidden, head).t().contiguous().float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
