"""Paged attention in plain torch (the CPU path; ``triton_attention.py`` has the same functions).

KV cache layout, shared with the Triton kernels: per layer ``key_cache`` and ``value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot = block_id * block_size + offset.

A step's queries are flattened: sequence b owns rows ``query_start_loc[b]:query_start_loc[b+1]`` and
its i-th query sits at position ``seq_lens[b] - q_len_b + i`` (causal, it sees positions <= its own)::

    query rows  | seq 0 (decode) | seq 1 (decode) | seq 2 (prefill chunk, 3 tokens) |
    context     |  0 ....... 41  |  0 .... 17     |  0 ... 9 (cached) 10 11 12      |

Sequences with one query token (decodes) are batched together. With the native kernel
(``cpu_decode_kernel.py``) they attend straight from the paged cache; without it their KV is
gathered at once, padded to the longest context and masked, then one grouped matmul serves all of
them (no KV-head expansion: queries are grouped by KV head instead). The native kernel also serves
short chunks (a speculative verification's 1 + k queries) as one decode row per query, each row's
context ending at its own position (``core.kernel_settings.rows_as_decodes``). Longer queries
(prefills) run per sequence with SDPA (4-D inputs + ``enable_gqa`` take torch's CPU flash kernel,
faster than 3-D ones). At decode shapes the grouped matmul beat SDPA ``enable_gqa``; the figures
are in docs/cpu-backend.md, "Attention".

Sliding window (``window``, Mistral, Gemma's local layers): a query at position p sees keys at
positions ``(p - window, p]`` only (HF's ``kv_idx > q_idx - sliding_window``), so the gathers start
at the first visible position and never touch blocks the KV manager freed. Soft-capping
(``softcap``, Gemma 2): scores ``s -> softcap * tanh(s / softcap)`` before the mask and softmax;
SDPA has no such hook, so capped prefills take the plain matmul path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from twinserve.core.kernel_settings import rows_as_decodes
from twinserve.gpu.kernels.cpu_decode_kernel import PagedDecode


@dataclass(slots=True)
class AttentionPlan:
    """Per-step gather indices, computed once and reused by every layer.

    ``decode_rows``: query rows of single-token sequences (with a native ``decode_kernel`` also
    every row of a short chunk, ``rows_as_decodes``: a verification's 1 + k). With it, their
    ``decode_tables[Bd, M]`` and ``decode_lens[Bd]`` (int32); without, ``decode_slots[Bd, L]``: their
    KV slots, padded, and ``decode_mask[1, Bd, 1, L]``: 0 where visible, -inf on padding.
    ``prefills``: for each multi-token sequence ``(row_start, row_end, context_slots[ctx],
    first_position)``: the slots of the positions its queries can see, from ``first_position``.
    ``window``: the attention window the plan was made for (None: full attention).
    """

    decode_rows: torch.Tensor | None
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[tuple[int, int, torch.Tensor, int]]
    decode_kernel: PagedDecode | None = None
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    window: int | None = None


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[T, Hkv, D]`` at ``slot_mapping[T]`` (int64) of the paged caches."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, block_size: int,
                   decode_kernel: PagedDecode | None = None,
                   window: int | None = None) -> AttentionPlan:
    """Gather indices for one step (see ``AttentionPlan``); the mask is float32."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode: list[tuple[int, int, int]] = []  # (query row, sequence, its context) per decode row
    prefills = []
    for b, length in enumerate(lens):
        q = starts[b + 1] - starts[b]
        if q == 1:
            decode.append((starts[b], b, length))
        elif decode_kernel is not None and rows_as_decodes(q, length, window):
            decode.extend((starts[b] + i, b, length - q + 1 + i) for i in range(q))
        else:
            first = 0 if window is None else max(0, length - q - window + 1)
            pos = torch.arange(first, length)
            slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
            prefills.append((starts[b], starts[b + 1], slots, first))
    if not decode:
        return AttentionPlan(None, None, None, prefills, window=window)
    rows, seqs, contexts = (torch.tensor(column, dtype=torch.long) for column in zip(*decode))
    if decode_kernel is not None:
        return AttentionPlan(rows, None, None, prefills, decode_kernel,
                             block_tables[seqs].to(torch.int32), contexts.to(torch.int32), window)
    first = torch.zeros_like(contexts) if window is None else (contexts - window).clamp_(min=0)
    visible = contexts - first
    max_len = int(visible.max())
    pos = first[:, None] + torch.arange(max_len)[None, :]
    pos = torch.minimum(pos, contexts[:, None] - 1)  # padding re-reads the last slot, masked
    tables = torch.gather(block_tables[seqs].long(), 1, pos // block_size)
    slots = tables * block_size + pos % block_size
    mask = torch.zeros(len(decode), max_len)
    mask.masked_fill_(torch.arange(max_len)[None, :] >= visible[:, None], float("-inf"))
    return AttentionPlan(rows, slots, mask[None, :, None, :], prefills, window=window)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    decode_kernel: PagedDecode | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of ``query[T, Hq, D]`` over the paged KV (within ``window`` positions
    when given, scores soft-capped at ``softcap`` when given); returns ``[T, Hq, D]``."""
    plan = plan_attention(block_tables, seq_lens, query_start_loc, key_cache.shape[1],
                          decode_kernel, window)
    return planned_attention(query, key_cache, value_cache, plan, scale, softcap)


def planned_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      plan: AttentionPlan, scale: float,
                      softcap: float | None = None) -> torch.Tensor:
    """``paged_attention`` with the gather indices precomputed by ``plan_attention``."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    if plan.decode_rows is not None and not plan.prefills:
        return _decode_attention(query, key_cache, value_cache, plan, scale, softcap)
    out = torch.empty_like(query)
    if plan.decode_rows is not None:
        out[plan.decode_rows] = _decode_attention(query[plan.decode_rows], key_cache, value_cache,
                                                  plan, scale, softcap)
    keys = key_cache.view(-1, num_kv_heads, head_dim)
    values = value_cache.view(-1, num_kv_heads, head_dim)
    for row_start, row_end, slots, first in plan.prefills:
        out[row_start:row_end] = _prefill_attention(
            query[row_start:row_end], keys.index_select(0, slots), values.index_select(0, slots),
            scale, first, plan.window, softcap)
    return out


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      plan: AttentionPlan, scale: float,
                      softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence, ``query[Bd, Hq, D]``: the native kernel where the plan has
    one, else a gathered, padded copy of the KV.

    That copy is gathered head-major (``[Hkv, Bd, L, D]``, contiguous), so both matmuls batch over
    ``(Hkv, Bd)`` without copying K or V into another layout; a slot-major gather followed by a
    permute spent more time in that copy than in the gather itself."""
    if plan.decode_kernel is not None:
        if plan.window is None and softcap is None:
            return plan.decode_kernel(query, key_cache, value_cache, plan.decode_tables,
                                      plan.decode_lens, scale)
        return plan.decode_kernel(query, key_cache, value_cache, plan.decode_tables,
                                  plan.decode_lens, scale, plan.window or 0, softcap or 0.0)
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    keys = key_cache.view(-1, num_kv_heads, head_dim)
    values = value_cache.view(-1, num_kv_heads, head_dim)
    ctx = plan.decode_slots.shape[1]
    flat = plan.decode_slots.reshape(-1)
    k = _gather_head_major(keys, flat).view(num_kv_heads, batch, ctx, head_dim)
    v = _gather_head_major(values, flat).view(num_kv_heads, batch, ctx, head_dim)
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    scores.add_(plan.decode_mask)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)     # [Hkv, Bd, G, L]
    return torch.matmul(probs, v).transpose(0, 1).reshape(batch, num_heads, head_dim)


def _gather_head_major(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slots]`` of a ``[S, Hkv, D]`` cache, laid out ``[Hkv, len(slots), D]``."""
    num_kv_heads, head_dim = cache.shape[1], cache.shape[2]
    out = cache.new_empty(num_kv_heads, slots.numel(), head_dim)
    for h in range(num_kv_heads):  # index_select gathers ~3x faster than advanced indexing
        torch.index_select(cache[:, h], 0, slots, out=out[h])
    return out


def _prefill_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scale: float, first: int = 0, window: int | None = None,
                       softcap: float | None = None) -> torch.Tensor:
    """One sequence's chunk: ``query[q, Hq, D]`` against the context it can see,
    ``keys[ctx, Hkv, D]`` from position ``first``. 4-D inputs select torch's CPU flash kernel
    (3-D ones fall back to the ~2x slower math path)."""
    q_len = query.shape[0]
    ctx_len = keys.shape[0]
    q = query.transpose(0, 1)[None]
    k = keys.transpose(0, 1)[None]
    v = values.transpose(0, 1)[None]
    if ctx_len == q_len and window is None and softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)
    rows = torch.arange(ctx_len - q_len, ctx_len)[:, None]  # query positions - first
    cols = torch.arange(ctx_len)[None, :]
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)
    group = query.shape[1] // keys.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = soft_cap(torch.matmul(q, k.transpose(-1, -2)).float() * scale, softcap)
    scores.masked_fill_(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    return out[0].transpose(0, 1)


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's logit soft-capping: ``cap * tanh(scores / cap)``."""
    return torch.tanh(scores / cap) * cap
