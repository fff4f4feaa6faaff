"""The decoder of the registered families (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, and the
mixtures of experts Mixtral, Qwen2/3-MoE) over a flattened batch.

One forward serves prefills, chunked prefills and decodes together: ``input_ids[T]`` and
``positions[T]`` concatenate every scheduled sequence's new tokens, ``AttentionMetadata`` says where
each sequence's rows are and where its KV lives. A decoder layer's projections are the linear
layers (``gpu/layers/linear.py``) its architecture entry names (``core/architectures``): q/k/v fused in
one ``qkv_proj`` and gate/up in one ``gate_up_proj`` (one product each instead of three and two).
An entry with ``qk_norm`` (Qwen3) adds a per-head RMSNorm on q and k before RoPE. Gemma's entries
add (1 + w) norms, norms after attention and around the MLP, a scaled embedding and GeGLU; the
config gives each layer its attention window, RoPE and soft-capping; an MoE config replaces the
MLP by ``gpu/layers/moe.py``'s experts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from twinserve.core.kernel_settings import DEFAULT_KERNELS, KernelSettings
from twinserve.core.model_config import ModelConfig
from twinserve.gpu.distributed.parallel_state import TPGroup
from twinserve.gpu.kernels.cpu_gemm import Gemm
from twinserve.gpu.layers.attention_backend import AttentionBackend, AttentionMetadata
from twinserve.gpu.layers.linear import LinearBase, LinearMethodBase, LinearOptions, linear_from_spec
from twinserve.gpu.layers.moe import SparseMoE
from twinserve.gpu.layers.rope import RotaryEmbedding, apply_rope
from twinserve.gpu.layers.vocab_parallel_embedding import VocabParallel

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin for this step's positions


class DecoderLayer(nn.Module):
    """Pre-norm attention and gated MLP; the projections ``qkv_proj``, ``o_proj``,
    ``gate_up_proj`` and ``down_proj`` are built from the architecture entry's ``linears``;
    ``q_norm`` / ``k_norm`` ([head_dim]) exist only when the entry has ``qk_norm``; ``moe``
    (and a shared expert's ``shared_gate_up_proj``, ``shared_down_proj``,
    ``shared_expert_gate``) only in a mixture of experts. ``rope_index`` picks the model's RoPE
    table this layer uses."""

    input_layernorm: nn.Parameter
    post_attention_layernorm: nn.Parameter
    pre_feedforward_layernorm: nn.Parameter  # Gemma (sandwich norms) only
    post_feedforward_layernorm: nn.Parameter
    qkv_proj: LinearBase
    o_proj: LinearBase
    gate_up_proj: LinearBase
    down_proj: LinearBase
    q_norm: nn.Parameter | None
    k_norm: nn.Parameter | None
    shared_gate_up_proj: LinearBase  # a shared expert (Qwen2-MoE) only
    shared_down_proj: LinearBase
    rope_index: int

    def __init__(self, config: ModelConfig, options: LinearOptions, layer: int = 0,
                 rope_index: int = 0) -> None:
        super().__init__()
        self.gemm = options.gemm
        # this rank's heads (tensor parallelism: KV heads replicated when fewer than ranks)
        self.num_heads = config.num_attention_heads // options.tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // options.tp_size)
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.window = config.layer_window(layer)
        self.softcap = config.attn_logit_softcapping
        self.rope_index = rope_index
        self.norm_fn = gemma_rms_norm if config.arch.norm_plus_one else rms_norm
        self.act = ACTIVATIONS[config.hidden_act]
        self.sandwich = config.arch.sandwich_norms
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
        moe = config.moe
        self.moe = None if moe is None else SparseMoE(moe, config.hidden_size, options.dtype,
                                                      options.device, options.gemm)
        self.shared_expert_gate = (None if moe is None or not moe.shared_expert_intermediate_size
                                   else _parameter(torch.empty(1, config.hidden_size,
                                                               dtype=options.dtype,
                                                               device=options.device)))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden if residual is None else residual + hidden
        x = self.norm_fn(residual, self.input_layernorm, self.eps)
        x = self._attention(x, rope, kv_cache, meta, backend)
        if self.sandwich:  # Gemma: norms after attention and around the MLP
            residual = residual + self.norm_fn(x, self.post_attention_layernorm, self.eps)
            x = self._mlp(self.norm_fn(residual, self.pre_feedforward_layernorm, self.eps))
            return self.norm_fn(x, self.post_feedforward_layernorm, self.eps), residual
        residual = residual + x
        x = self.norm_fn(residual, self.post_attention_layernorm, self.eps)
        return self._mlp(x), residual

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe is None:
            return self._gated(x, self.gate_up_proj, self.down_proj)
        out = self.moe.forward(x)
        if self.shared_expert_gate is not None:  # Qwen2-MoE's shared expert, sigmoid-gated
            shared = self._gated(x, self.shared_gate_up_proj, self.shared_down_proj)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
        return out

    def _gated(self, x: torch.Tensor, gate_up_proj: LinearBase,
               down_proj: LinearBase) -> torch.Tensor:
        # ``forward`` directly: nn.Module.__call__'s hook dispatch, four times a layer, is
        # measurable at batch-1 decode on a 2-core CPU.
        if self.gemm.plain(x.shape[0]):
            gate, up = gate_up_proj.forward(x).chunk(2, dim=-1)
            return down_proj.forward(self.act(gate) * up)
        gate_up = gate_up_proj.forward_feature_major(x)  # [2 * intermediate, T]
        gate, up = gate_up.chunk(2, dim=0)
        return down_proj.forward(self.act(gate).mul_(up).t())

    def _attention(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache,
                   meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        qkv = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = qkv[:, :self.num_heads + self.num_kv_heads]
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per head, before RoPE
            norm = self.norm_fn
            qk = torch.cat((norm(qk[:, :self.num_heads], self.q_norm, self.eps),
                            norm(qk[:, self.num_heads:], self.k_norm, self.eps)), dim=1)
        qk = apply_rope(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        key_cache, value_cache = kv_cache
        backend.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = backend.attend(q, key_cache, value_cache, meta, self.scale, self.window,
                             self.softcap)
        return self.o_proj.forward(out.reshape(num_tokens, -1))


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and (possibly tied) LM head. Parameters are
    allocated (uninitialised) in ``dtype`` on ``device``; ``model_loader`` fills them.
    ``kernels``: the engine's kernel choices (the attention backend's and, in
    ``QuantizedCausalLM``, the quantized products' and the fused decode step's)."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device, tp_group: TPGroup | None = None,
                 quant_method: LinearMethodBase | None = None,
                 kernels: KernelSettings = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.gemm = Gemm.for_device(device, dtype)
        tp_rank, tp_size = (0, 1) if tp_group is None else (tp_group.rank, tp_group.world_size)
        options = LinearOptions(self.gemm, dtype, device, quant_method=quant_method,
                                tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
        self.vocab = VocabParallel(config.vocab_size, tp_group)  # embedding and LM head rows
        # pipeline parallelism: this stage's layers only; the first holds the embedding, the
        # last the norm and the head (and the embedding too when the head is tied to it)
        self.pipeline = None if tp_group is None else tp_group.pipeline
        stage = None if self.pipeline is None else self.pipeline.layout
        first, last = stage is None or stage.is_first, stage is None or stage.is_last
        self.layer_range = (0, config.num_hidden_layers) if stage is None else (stage.start, stage.end)
        embedding = (self.vocab.rows_per_rank, config.hidden_size)
        self.embed_tokens = (_parameter(torch.empty(embedding, dtype=dtype, device=device))
                             if first or (last and config.tie_word_embeddings) else None)
        ropes = [config.layer_rope(i) for i in range(config.num_hidden_layers)]
        distinct = list(dict.fromkeys(repr(r) for r in ropes))  # theta + scaling, in layer order
        start, end = self.layer_range
        self.layers = nn.ModuleList(
            DecoderLayer(config, options, i, distinct.index(repr(r))) if start <= i < end
            else MissingLayer() for i, r in enumerate(ropes))
        self.norm = (_parameter(torch.ones(config.hidden_size, dtype=dtype, device=device))
                     if last else None)
        self.lm_head = (None if config.tie_word_embeddings or not last else
                        _parameter(torch.empty(embedding, dtype=dtype, device=device)))
        for head in (self.embed_tokens, self.lm_head):
            if head is not None and tp_size > 1:
                head.weight_loader = self.vocab.weight_loader  # type: ignore[attr-defined]
        by_key = {repr(r): r for r in ropes}
        self.ropes = [RotaryEmbedding(config.head_dim, max_positions, *by_key[key], dtype, device)
                      for key in distinct]
        self.rope = self.ropes[0]
        self.backend = AttentionBackend(device, (config.layer_window(i)
                                                 for i in range(config.num_hidden_layers)),
                                        kernels.cpu_attention)
        self.norm_fn = gemma_rms_norm if config.arch.norm_plus_one else rms_norm
        # Gemma scales the embedding by sqrt(hidden_size), rounded to the model's dtype
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5, dtype=dtype).item()
                            if config.arch.embed_scale else None)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> CausalLM:
        """``to(dtype)``/``to(device)`` carry the RoPE tables too (plain tensors, not buffers):
        a model quantized from float32 and then cast to bf16 otherwise rotated in float32, and
        its keys reached the bf16 KV cache as float32."""
        super()._apply(fn, recurse)
        for rope in self.ropes:
            rope.cos, rope.sin = fn(rope.cos), fn(rope.sin)
        return self

    def set_gemm(self, gemm: Gemm) -> None:
        """Run every weight product (layers' projections, LM head) through ``gemm``."""
        self.gemm = gemm
        for module in self.modules():
            if isinstance(module, (DecoderLayer, LinearBase, SparseMoE)):
                module.gemm = gemm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` (normed) for every scheduled token. A stage
        before the last sends its hidden states and residual on and returns its hidden states
        (a placeholder of the right shape: the logits come back in ``compute_logits``)."""
        pp = self.pipeline
        residual: torch.Tensor | None = None
        if pp is None or pp.layout.is_first:
            hidden = self.embed(input_ids)
            if self.embed_scale is not None:
                hidden = hidden * self.embed_scale
        else:
            dtype = self.layers[pp.layout.start].input_layernorm.dtype  # (follows ``to(dtype)``)
            hidden, residual = pp.recv_prev(input_ids.shape[0], self.config.hidden_size, dtype)
        ropes = [rope.lookup(positions) for rope in self.ropes]
        start, end = self.layer_range
        for i in range(start, end):  # a stage's KV cache holds its layers only
            layer = self.layers[i]
            index: int = layer.rope_index  # type: ignore[assignment]
            hidden, residual = layer(hidden, residual, ropes[index], kv_caches[i - start],
                                     meta.for_layer(i), self.backend)
        assert residual is not None
        if pp is not None and not pp.layout.is_last:
            pp.send_next(hidden, residual)
            return hidden
        assert self.norm is not None
        return self.norm_fn(residual + hidden, self.norm, self.config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` (a quantized model reads them from its blocks)."""
        assert self.embed_tokens is not None  # (the first stage's)
        return self.vocab.embed(input_ids, self.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` for the rows that sample. Under pipeline parallelism
        the last stage computes them and sends them to the driver, which receives them here."""
        pp = self.pipeline
        if pp is not None and not pp.layout.is_last:
            if pp.logits is None:
                raise RuntimeError("only the last pipeline stage and the driver hold logits.")
            return pp.recv_logits(hidden.shape[0], self.config.vocab_size)
        logits = self._logits(hidden)
        if pp is not None and pp.logits is not None:
            pp.send_logits(logits)
        return logits

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        assert head is not None
        if self.gemm.plain(hidden.shape[0]):
            logits = self.vocab.gather_logits(F.linear(hidden, head).float())
        else:
            logits = self.vocab.gather_logits(
                self.gemm.feature_major(hidden, head).t().contiguous().float())
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds (vLLM's ``PPMissingLayer``): no parameters, never run."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("this decoder layer belongs to another pipeline stage.")


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise and scale by (1 + weight) in float32, then cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType({
    "silu": F.silu, "gelu_tanh": _gelu_tanh})
