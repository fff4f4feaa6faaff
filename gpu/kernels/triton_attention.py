"""Triton kernels for paged attention over twinserve's KV cache.

Same signatures and cache layout as the torch implementation in ``gpu/layers/attention.py``:

    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, head_dim]   (one pair per layer)
    slot                   = block_id * block_size + offset

Kernels (fp32 accumulation, fp32/bf16/fp16 inputs, any head_dim via masking, any block_size):

- ``_write_kv_cache_kernel``   one program per token: scatters its [Hkv, D] key and value rows to their slot.
- ``_paged_decode_kernel``     one program per (sequence, kv head[, split]): the GQA group's query heads are
                               the rows of one tile, online softmax over BLOCK_N cache positions at a time.
                               With NUM_SPLITS > 1 (flash-decoding) each program covers one slice of the
                               sequence and ``_decode_reduce_kernel`` merges the partial (acc, max, sum).
- ``_paged_prefill_kernel``    one program per (sequence, query tile, kv head): rows are BLOCK_Q query
                               tokens x GROUP query heads, online softmax over the cache with a causal mask.

``paged_attention`` routes decode-only batches (every q_len == 1) to the decode kernel, the rest
(prefills, chunked prefills / extends, mixed batches) to the prefill kernel.

Sliding window (``window`` > 0): a query at position p sees positions ``(p - window, p]`` only, and
the kernels start their walk at the first visible position (blocks before it may have been freed).
Soft-capping (``softcap`` > 0, Gemma 2): scores ``s -> softcap * tanh(s / softcap)`` before softmax.

The module imports without CUDA and without Triton (``HAS_TRITON`` is then False); kernels launch on CUDA
tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before this module was imported.
"""

from __future__ import annotations

import torch

from twinserve.gpu.kernels.triton_support import (
    HAS_TRITON,
    check_launchable,
    kernel_is_interpreted,
    next_pow2,
    tl,
    triton,
)

__all__ = [
    "HAS_TRITON",
    "write_kv_cache",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "is_interpreted",
]

_LOG2E = 1.4426950408889634


if HAS_TRITON:

    @triton.jit
    def _write_kv_cache_kernel(
        key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_kcb, stride_kcs, stride_kch, stride_kcd,
        stride_vcb, stride_vcs, stride_vch, stride_vcd,
        num_kv_heads, head_dim, block_size,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if slot < 0:  # padded token (e.g. a CUDA-graph batch): nothing to write
            return
        blk = slot // block_size
        off = slot % block_size
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
        t64 = t.to(tl.int64)
        k = tl.load(key_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                    mask=mask, other=0.0)
        v = tl.load(value_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                    mask=mask, other=0.0)
        kc = key_cache_ptr + blk * stride_kcb + off * stride_kcs
        vc = value_cache_ptr + blk * stride_vcb + off * stride_vcs
        tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
                 k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
                 v.to(value_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _attend_tile(
        q, m_i, l_i, acc,
        k_cache_ptr, v_cache_ptr, block_table_ptr, stride_btm,
        kvh, pos, valid,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        block_size, offs_d, d_mask, scale_log2, softcap,
        DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        """One online-softmax step: rows of ``q`` [R, D] against cache positions ``pos`` [N].

        ``valid`` [R, N] says which (row, position) pairs take part (causal mask, sequence end).
        Logits are kept in base 2 (scaled by scale * log2(e)) so that exp2 can be used.
        """
        n_in = tl.max(valid.to(tl.int32), axis=0) > 0  # [N] positions some row needs
        page = tl.load(block_table_ptr + (pos // block_size) * stride_btm, mask=n_in, other=0).to(tl.int64)
        off = (pos % block_size).to(tl.int64)
        k = tl.load(k_cache_ptr + page[None, :] * stride_kb + off[None, :] * stride_ks + kvh * stride_kh
                    + offs_d[:, None] * stride_kd,
                    mask=d_mask[:, None] & n_in[None, :], other=0.0)  # [D, N]
        v = tl.load(v_cache_ptr + page[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh
                    + offs_d[None, :] * stride_vd,
                    mask=n_in[:, None] & d_mask[None, :], other=0.0)  # [N, D]
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if SOFTCAP:  # cap the natural-unit score, then back to base 2; tanh(x) = 2 sigmoid(2x) - 1
            x = s * (scale_log2 / 1.4426950408889634) / softcap
            s = softcap * (2.0 * tl.sigmoid(2.0 * x) - 1.0) * 1.4426950408889634
        else:
            s = s * scale_log2
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing valid yet: no NaN
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        out_ptr, part_acc_ptr, part_ml_ptr,
        scale_log2, window, softcap,
        stride_qt, stride_qh, stride_qd,
        stride_ot, stride_oh, stride_od,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_btb, stride_btm,
        num_q_heads, block_size, head_dim,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if q_len == 0:
            return
        seq_len = tl.load(seq_lens_ptr + seq)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        d_mask = offs_d < head_dim
        heads = kvh * GROUP + offs_g
        t64 = q_start.to(tl.int64)
        q = tl.load(q_ptr + t64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)

        lo = 0
        if window > 0:  # sliding window: positions [seq_len - window, seq_len)
            lo = tl.maximum(seq_len - window, 0)
        if NUM_SPLITS == 1:
            start = lo
            end = seq_len
        else:  # flash-decoding: split `split` covers a contiguous run of BLOCK_N tiles
            tiles_per_split = tl.cdiv(tl.cdiv(seq_len - lo, BLOCK_N), NUM_SPLITS)
            start = lo + split * tiles_per_split * BLOCK_N
            end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        bt = block_tables_ptr + seq.to(tl.int64) * stride_btb
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            valid = g_mask[:, None] & (pos < end)[None, :]
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt, stride_btm, kvh, pos, valid,
                stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                block_size, offs_d, d_mask, scale_log2, softcap, DOT_FP32, SOFTCAP)

        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                     out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        else:
            # partials: acc [T, Hq, S, D] (unnormalised), ml [T, Hq, S, 2] (running max in log2 units, sum)
            row = (t64 * num_q_heads + heads) * NUM_SPLITS + split
            tl.store(part_acc_ptr + row[:, None] * head_dim + offs_d[None, :], acc,
                     mask=g_mask[:, None] & d_mask[None, :])
            tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)

    @triton.jit
    def _decode_reduce_kernel(
        part_acc_ptr, part_ml_ptr, query_start_loc_ptr, out_ptr,
        stride_ot, stride_oh, stride_od,
        num_q_heads, head_dim,
        NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        seq = tl.program_id(0)
        h = tl.program_id(1)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if q_len == 0:
            return
        t64 = q_start.to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < NUM_SPLITS
        d_mask = offs_d < head_dim
        row = (t64 * num_q_heads + h) * NUM_SPLITS + offs_s
        m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
        l_sum = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
        acc = tl.load(part_acc_ptr + row[:, None] * head_dim + offs_d[None, :],
                      mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        m_max = tl.max(m, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.math.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
        num = tl.sum(acc * w[:, None], axis=0)
        den = tl.sum(l_sum * w, axis=0)
        out = num / tl.where(den == 0.0, 1.0, den)
        tl.store(out_ptr + t64 * stride_ot + h * stride_oh + offs_d * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=d_mask)

    @triton.jit
    def _paged_prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
        scale_log2, window, softcap,
        stride_qt, stride_qh, stride_qd,
        stride_ot, stride_oh, stride_od,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_btb, stride_btm,
        block_size, head_dim,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        seq = tl.program_id(0)
        q_tile = tl.program_id(1)
        kvh = tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        tile_start = q_tile * BLOCK_Q
        if tile_start >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_len = seq_len - q_len  # tokens already in the cache before this step's queries

        # row r of the tile = query token tile_start + r // GROUP, query head kvh * GROUP + r % GROUP
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        q_idx = tile_start + offs_m // GROUP
        heads = kvh * GROUP + offs_m % GROUP
        row_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
        d_mask = offs_d < head_dim
        q_pos = ctx_len + q_idx
        tok = (q_start + q_idx).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh
                    + offs_d[None, :] * stride_qd,
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = ctx_len + tl.minimum(tile_start + BLOCK_Q, q_len)  # last query of the tile sees < kv_end
        bt = block_tables_ptr + seq.to(tl.int64) * stride_btb
        kv_start = 0
        if window > 0:  # the tile's first query sees positions > its own - window
            kv_start = tl.maximum(ctx_len + tile_start - window + 1, 0)
        for n0 in range(kv_start, kv_end, BLOCK_N):
            pos = n0 + offs_n
            valid = row_mask[:, None] & (pos[None, :] <= q_pos[:, None]) & (pos < kv_end)[None, :]
            if window > 0:
                valid = valid & (pos[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt, stride_btm, kvh, pos, valid,
                stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                block_size, offs_d, d_mask, scale_log2, softcap, DOT_FP32, SOFTCAP)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# ----------------------------------------------------------------------------------------------- host side


def is_interpreted() -> bool:
    """True when the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return HAS_TRITON and kernel_is_interpreted(_paged_decode_kernel)


def _check_launchable(t: torch.Tensor) -> None:
    check_launchable(t, "triton_attention", HAS_TRITON, is_interpreted())


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} != key_cache shape "
                         f"{tuple(key_cache.shape)}")


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, Hkv, D] into the paged caches at ``slot_mapping`` [T] (negative slot:
    skipped)."""
    _check_cache(key_cache, value_cache)
    if key.dim() != 3:
        raise ValueError(f"key must be [T, num_kv_heads, head_dim], got shape {tuple(key.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if tuple(key_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"key [T, {num_kv_heads}, {head_dim}] does not match key_cache heads/head_dim "
                         f"{tuple(key_cache.shape[2:])}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must have shape ({num_tokens},), got {tuple(slot_mapping.shape)}")
    _check_launchable(key)
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        num_kv_heads, head_dim, key_cache.shape[1],
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
    )


def _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc):
    _check_cache(key_cache, value_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be [T, Hq, D], got shape {tuple(query.shape)}")
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != key_cache head_dim {key_cache.shape[3]}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num query heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must have shape ({num_seqs + 1},), got "
                         f"{tuple(query_start_loc.shape)}")
    _check_launchable(query)
    return num_q_heads // num_kv_heads


def _dot_fp32(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    # fp32 inputs (or query and cache of different dtypes): exact (ieee) fp32 dots. CPU tensors run in the
    # interpreter, whose bf16/fp16 tl.dot is wrong: upcast there too. On CUDA, bf16/fp16 use tensor-core
    # dots with fp32 accumulation (P is rounded to the value dtype before P @ V, as in FlashAttention).
    return (query.dtype == torch.float32 or key_cache.dtype != query.dtype
            or query.device.type != "cuda")


def _default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Flash-decoding split count: fill the SMs when (sequences x kv heads) alone would not."""
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = 1  # interpreter: programs run one after another, splitting only adds work
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= num_sms or max_seq_len <= 512:
        return 1
    by_occupancy = -(-2 * num_sms // programs)
    by_length = max_seq_len // 256  # keep at least ~256 positions per split
    return max(1, min(16, by_occupancy, by_length))


def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                           scale: float, *, num_splits: int | None = None, max_seq_len: int | None = None,
                           block_n: int | None = None, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Decode attention (one query token per sequence) over the paged cache; returns [T, Hq, D].

    One program per (sequence, kv head) handles the GQA group's query heads as the rows of a tile;
    ``num_splits`` > 1 splits each sequence's positions over that many programs (flash-decoding) and merges
    them in a second kernel. ``max_seq_len`` (host int) avoids a device sync when choosing the split count.
    """
    group = _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        if window is not None:
            max_seq_len = min(max_seq_len, window)
        num_splits = _default_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # 64-position KV tiles: ptxas (sm_90, bf16, head_dim 128, unit last-dim strides) gives 96 registers,
    # no spills. Small tiles in the interpreter only keep the tests' tiles and splits numerous.
    block_n = block_n or (16 if is_interpreted() else 64)
    block_d = next_pow2(max(16, head_dim))
    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty((num_tokens, num_q_heads, num_splits, 2), dtype=torch.float32,
                              device=query.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        out, part_acc, part_ml,
        float(scale) * _LOG2E, _window_arg(window), float(softcap or 0.0),
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(),
        num_q_heads, key_cache.shape[1], head_dim,
        GROUP=group, BLOCK_G=next_pow2(max(16, group)), BLOCK_N=block_n, BLOCK_D=block_d,
        NUM_SPLITS=num_splits, DOT_FP32=_dot_fp32(query, key_cache), SOFTCAP=softcap is not None,
        num_warps=4,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            part_acc, part_ml, query_start_loc, out, *out.stride(), num_q_heads, head_dim,
            NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d,
        )
    return out


def paged_prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                            scale: float, *, max_query_len: int | None = None, block_m: int | None = None,
                            block_n: int | None = None, window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Causal attention for a varlen batch (prefills, extends, decodes) over the paged cache.

    Grid (sequence, query tile, kv head). A tile's BLOCK_M rows are BLOCK_Q = BLOCK_M // GROUP query tokens
    times the GROUP query heads sharing one kv head, so each K/V tile is loaded once for the whole group:

        rows:  (q0,h0) (q0,h1) (q1,h0) (q1,h1) ...      query token i of sequence b sits at position
        cols:  cache positions n0 .. n0+BLOCK_N-1        seq_len_b - q_len_b + i and sees positions <= it
               -> page block_tables[b, pos // block_size], offset pos % block_size
    """
    group = _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    # 64 x 64 tiles; head_dim 128 uses 8 warps (ptxas sm_90 bf16: 162 registers, 191 at 4 warps).
    block_m = next_pow2(max(16, group, block_m or 64))
    block_q = block_m // group
    block_n = block_n or (32 if is_interpreted() else 64)
    grid = (num_seqs, triton.cdiv(max(1, max_query_len), block_q), num_kv_heads)
    _paged_prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        float(scale) * _LOG2E, _window_arg(window), float(softcap or 0.0),
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(),
        key_cache.shape[1], head_dim,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=next_pow2(max(16, head_dim)), DOT_FP32=_dot_fp32(query, key_cache),
        SOFTCAP=softcap is not None,
        num_warps=8 if head_dim > 64 else 4,
    )
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, *, max_query_len: int | None = None,
                    max_seq_len: int | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Attention for a flattened varlen batch over the paged KV cache; returns [T, Hq, D].

    query [T, Hq, D]; block_tables [B, M] int32; seq_lens [B] int32 (tokens in the cache, this step's
    included); query_start_loc [B+1] int32. Decode-only batches go to the decode kernel, the rest to the
    prefill/extend kernel. Pass ``max_query_len`` / ``max_seq_len`` (host ints) to avoid device syncs.
    """
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if seq_lens.numel() else 0
    if max_query_len <= 1:
        return paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                      scale, max_seq_len=max_seq_len, window=window, softcap=softcap)
    return paged_prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                   scale, max_query_len=max_query_len, window=window, softcap=softcap)


def _window_arg(window: int | None) -> int:
    """The kernels' window argument: 0 for full attention."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"window must be a positive integer or None, got {window!r}")
    return window
