"""The dense decoder of the registered families (Llama, Mistral, Qwen2, Qwen3) over a flattened
batch.

One forward serves prefills, chunked prefills and decodes together: ``input_ids[T]`` and
``positions[T]`` concatenate every scheduled sequence's new tokens, ``AttentionMetadata`` says where
each sequence's rows are and where its KV lives. A decoder layer's projections are the linear
layers (``gpu/linear.py``) its architecture entry names (``core/architectures``): q/k/v fused in
one ``qkv_proj`` and gate/up in one ``gate_up_proj`` (one product each instead of three and two).
An entry with ``qk_norm`` (Qwen3) adds a per-head RMSNorm on q and k before RoPE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twinserve.core.model_config import ModelConfig
from twinserve.gpu.attention_backend import AttentionBackend, AttentionMetadata
from twinserve.gpu.cpu_gemm import Gemm
from twinserve.gpu.linear import LinearBase, LinearOptions, linear_from_spec
from twinserve.gpu.rope import RotaryEmbedding, apply_rope

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin for this step's positions


class DecoderLayer(nn.Module):
    """Pre-norm attention and SiLU-gated MLP; the projections ``qkv_proj``, ``o_proj``,
    ``gate_up_proj`` and ``down_proj`` are built from the architecture entry's ``linears``;
    ``q_norm`` / ``k_norm`` ([head_dim]) exist only when the entry has ``qk_norm``."""

    input_layernorm: nn.Parameter
    post_attention_layernorm: nn.Parameter
    qkv_proj: LinearBase
    o_proj: LinearBase
    gate_up_proj: LinearBase
    down_proj: LinearBase
    q_norm: nn.Parameter | None
    k_norm: nn.Parameter | None

    def __init__(self, config: ModelConfig, options: LinearOptions) -> None:
        super().__init__()
        self.gemm = options.gemm
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim ** -0.5
        for norm in config.arch.norms:
            setattr(self, norm, _parameter(torch.ones(config.hidden_size, dtype=options.dtype,
                                                      device=options.device)))
        for spec in config.arch.linears(config):
            setattr(self, spec.name, linear_from_spec(spec, config, options))
        if config.arch.qk_norm:
            head = (config.head_dim,)
            self.q_norm = _parameter(torch.ones(head, dtype=options.dtype, device=options.device))
            self.k_norm = _parameter(torch.ones(head, dtype=options.dtype, device=options.device))
        else:
            self.q_norm = self.k_norm = None

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
        # ``forward`` directly: nn.Module.__call__'s hook dispatch, four times a layer, is
        # measurable at batch-1 decode on a 2-core CPU.
        if self.gemm.plain(x.shape[0]):
            gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
            return self.down_proj.forward(F.silu(gate) * up)
        gate_up = self.gate_up_proj.forward_feature_major(x)  # [2 * intermediate, T]
        gate, up = gate_up.chunk(2, dim=0)
        return self.down_proj.forward(F.silu(gate).mul_(up).t())

    def _attention(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache,
                   meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        qkv = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = qkv[:, :self.num_heads + self.num_kv_heads]
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per head, before RoPE
            qk = torch.cat((rms_norm(qk[:, :self.num_heads], self.q_norm, self.eps),
                            rms_norm(qk[:, self.num_heads:], self.k_norm, self.eps)), dim=1)
        qk = apply_rope(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        key_cache, value_cache = kv_cache
        backend.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = backend.attend(q, key_cache, value_cache, meta, self.scale)
        return self.o_proj.forward(out.reshape(num_tokens, -1))


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and (possibly tied) LM head. Parameters are
    allocated (uninitialised) in ``dtype`` on ``device``; ``model_loader`` fills them."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.gemm = Gemm.for_device(device, dtype)
        options = LinearOptions(self.gemm, dtype, device)
        embedding = (config.vocab_size, config.hidden_size)
        self.embed_tokens = _parameter(torch.empty(embedding, dtype=dtype, device=device))
        self.layers = nn.ModuleList(DecoderLayer(config, options)
                                    for _ in range(config.num_hidden_layers))
        self.norm = _parameter(torch.ones(config.hidden_size, dtype=dtype, device=device))
        self.lm_head = (None if config.tie_word_embeddings else
                        _parameter(torch.empty(embedding, dtype=dtype, device=device)))
        self.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                    config.rope_scaling, dtype, device)
        self.backend = AttentionBackend(device)

    def set_gemm(self, gemm: Gemm) -> None:
        """Run every weight product (layers' projections, LM head) through ``gemm``."""
        self.gemm = gemm
        for module in self.modules():
            if isinstance(module, (DecoderLayer, LinearBase)):
                module.gemm = gemm

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


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
