"""Triton kernels for batched multi-LoRA (Punica SGMV-style shrink and expand).

A step's tokens are grouped into segments, one per adapter in use; the adapters' weights sit in slots of
stacked tensors (slot = the adapter loaded there, R = the largest rank, smaller ranks zero-padded):

    x          [T, K]       the layer input, one row per token of the step
    lora_a     [S, R, K]    shrink weights                     h   = x @ A[slot].T      [T, R]  fp32
    lora_b     [S, N, R]    expand weights                     out += h @ B[slot].T     [T, N]  model dtype
    sorted_rows   int32 [M]    rows of x, grouped by segment:  segment g is
    seg_start     int32 [L+1]    sorted_rows[seg_start[g]:seg_start[g+1]], with adapter slot seg_slot[g]
    seg_slot      int32 [L]      (a row is in at most one segment; segments may be empty)

Rows in no segment (tokens without an adapter) get h = 0 and leave ``out`` untouched. Both kernels run on a
grid (segment, row tile of the segment, column tile); a program gathers its BLOCK_M rows through
``sorted_rows``, loads one slot's weight tile and accumulates in fp32. ``lora_shrink`` may also split K over
programs (SPLIT_K > 1: fp32 atomic adds into the zeroed h, which is then not bit-reproducible) so that a
decode step's few short segments still fill the GPU. ``h_offset`` lets several expands read column slices of
one h (e.g. a fused QKV shrink with A = [S, 3R, K], then three expands into column slices of the QKV output).

The module imports without CUDA and without Triton (``HAS_TRITON`` is then False); kernels launch on CUDA
tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before this module was imported.
``lora_shrink_reference`` / ``lora_expand_reference`` are the same operations in plain torch.
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
    "is_interpreted",
    "lora_shrink",
    "lora_expand",
    "lora_shrink_reference",
    "lora_expand_reference",
]


if HAS_TRITON:

    @triton.jit
    def _segment_rows(sorted_rows_ptr, seg_start_ptr, g, m0, BLOCK_M: tl.constexpr):
        """Rows [m0, m0 + BLOCK_M) of segment g: (row indices as int64, their mask, the segment's length)."""
        start = tl.load(seg_start_ptr + g)
        seg_len = tl.load(seg_start_ptr + g + 1) - start
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < seg_len
        rows = tl.load(sorted_rows_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        return rows, m_mask, seg_len

    @triton.jit
    def _lora_shrink_kernel(
        x_ptr, a_ptr, h_ptr, sorted_rows_ptr, seg_start_ptr, seg_slot_ptr,
        stride_xt, stride_xk,
        stride_as, stride_ar, stride_ak,
        stride_ht, stride_hr,
        K, R, k_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr,
    ):
        g = tl.program_id(0)
        m0 = tl.program_id(1) * BLOCK_M
        n_tile = tl.program_id(2) // SPLIT_K
        split = tl.program_id(2) % SPLIT_K
        rows, m_mask, seg_len = _segment_rows(sorted_rows_ptr, seg_start_ptr, g, m0, BLOCK_M)
        if m0 >= seg_len:  # the grid is sized for the longest segment
            return
        slot = tl.load(seg_slot_ptr + g).to(tl.int64)
        offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < R
        offs_k = tl.arange(0, BLOCK_K)
        k_begin = split * k_per_split  # k_per_split is a multiple of BLOCK_K
        k_end = tl.minimum(k_begin + k_per_split, K)
        x_base = x_ptr + rows[:, None] * stride_xt
        a_base = a_ptr + slot * stride_as + offs_n[None, :] * stride_ar
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < k_end
            x = tl.load(x_base + ks[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(a_base + ks[:, None] * stride_ak, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        h_ptrs = h_ptr + rows[:, None] * stride_ht + offs_n[None, :] * stride_hr
        mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            tl.store(h_ptrs, acc, mask=mask)
        else:
            tl.atomic_add(h_ptrs, acc, mask=mask)

    @triton.jit
    def _lora_expand_kernel(
        h_ptr, b_ptr, out_ptr, sorted_rows_ptr, seg_start_ptr, seg_slot_ptr,
        stride_ht, stride_hr,
        stride_bs, stride_bn, stride_br,
        stride_ot, stride_on,
        N, R, h_offset,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_IEEE: tl.constexpr,
    ):
        g = tl.program_id(0)
        m0 = tl.program_id(1) * BLOCK_M
        rows, m_mask, seg_len = _segment_rows(sorted_rows_ptr, seg_start_ptr, g, m0, BLOCK_M)
        if m0 >= seg_len:
            return
        slot = tl.load(seg_slot_ptr + g).to(tl.int64)
        offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_r = tl.arange(0, BLOCK_R)
        h_base = h_ptr + rows[:, None] * stride_ht
        b_base = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rs = r0 + offs_r
            r_mask = rs < R
            h = tl.load(h_base + (h_offset + rs[None, :]) * stride_hr, mask=m_mask[:, None] & r_mask[None, :],
                        other=0.0)
            b = tl.load(b_base + rs[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            # h is fp32, so B is upcast: tf32 tensor cores, or exact fp32 (fp32 model, interpreter)
            if DOT_IEEE:
                acc += tl.dot(h, b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(h, b.to(tl.float32), input_precision="tf32")
        out_ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :] * stride_on
        mask = m_mask[:, None] & n_mask[None, :]
        delta = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # as the reference: delta in out's dtype
        prev = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (prev + delta).to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------- host side


def is_interpreted() -> bool:
    """True when the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return HAS_TRITON and kernel_is_interpreted(_lora_shrink_kernel)


def _check_launchable(t: torch.Tensor) -> None:
    check_launchable(t, "triton_lora", HAS_TRITON, is_interpreted())


def _check_segments(num_rows: int, num_slots: int, sorted_rows: torch.Tensor, seg_start: torch.Tensor,
                    seg_slot: torch.Tensor, max_seg_len: int) -> None:
    """Shapes and dtypes only: the values stay on the device (no sync)."""
    for name, t in (("sorted_rows", sorted_rows), ("seg_start", seg_start), ("seg_slot", seg_slot)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-d int32 tensor, got {t.dtype} shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if sorted_rows.shape[0] > num_rows:
        raise ValueError(f"sorted_rows has {sorted_rows.shape[0]} entries, more than the {num_rows} rows")
    if seg_start.shape[0] != seg_slot.shape[0] + 1:
        raise ValueError(f"seg_start must have len(seg_slot) + 1 = {seg_slot.shape[0] + 1} entries, "
                         f"got {seg_start.shape[0]}")
    if seg_slot.shape[0] > 0 and num_slots == 0:
        raise ValueError("seg_slot names adapter slots but the LoRA weights have no slots (S == 0)")
    if max_seg_len < 0:
        raise ValueError(f"max_seg_len must be >= 0, got {max_seg_len}")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors on different devices: {devices}")


def _block_m(max_seg_len: int) -> int:
    # tl.dot needs >= 16 rows; decode segments (1 row each) waste the rest of a 16-row tile, long prefill
    # segments use 64-row tiles so each weight tile is loaded for more rows.
    return min(64, next_pow2(max(16, max_seg_len)))


def _shrink_split_k(num_programs: int, k: int, block_k: int, device: torch.device) -> int:
    """Split K over programs when (segments x row tiles x rank tiles) would leave most SMs idle."""
    if device.type != "cuda":
        return 1  # interpreter: programs run one after another, splitting only adds work
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    k_tiles = triton.cdiv(k, block_k)
    if num_programs >= num_sms or k_tiles < 4:
        return 1
    by_occupancy = triton.cdiv(2 * num_sms, num_programs)
    return max(1, min(32, by_occupancy, k_tiles // 2))  # keep at least two K tiles per split


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, sorted_rows: torch.Tensor,
                seg_start: torch.Tensor, seg_slot: torch.Tensor, max_seg_len: int,
                *, split_k: int | None = None) -> torch.Tensor:
    """h[T, R] float32: for each segment g and each row t in sorted_rows[seg_start[g]:seg_start[g+1]],
    h[t] = x[t] @ lora_a[seg_slot[g]].T; rows of x in no segment get zeros.

    x [T, K] (fp32/bf16/fp16, last dim contiguous); lora_a [S, R, K] of x's dtype. ``max_seg_len`` (host
    int, the longest segment) sizes the grid: rows past it in a longer segment would be left at zero.
    ``split_k`` overrides the number of programs K is split over (default: chosen to fill the GPU).
    """
    if x.dim() != 2 or lora_a.dim() != 3:
        raise ValueError(f"x must be [T, K] and lora_a [S, R, K], got shapes {tuple(x.shape)} and "
                         f"{tuple(lora_a.shape)}")
    num_rows, k = x.shape
    num_slots, rank = lora_a.shape[0], lora_a.shape[1]
    if lora_a.shape[2] != k:
        raise ValueError(f"lora_a has K = {lora_a.shape[2]}, x has K = {k}")
    if lora_a.dtype != x.dtype:
        raise ValueError(f"lora_a dtype {lora_a.dtype} != x dtype {x.dtype}")
    _check_segments(num_rows, num_slots, sorted_rows, seg_start, seg_slot, max_seg_len)
    _check_same_device(x=x, lora_a=lora_a, sorted_rows=sorted_rows, seg_start=seg_start, seg_slot=seg_slot)
    _check_launchable(x)
    h = torch.zeros((num_rows, rank), dtype=torch.float32, device=x.device)
    num_segments = seg_slot.shape[0]
    if num_segments == 0 or max_seg_len == 0 or rank == 0 or num_rows == 0:
        return h
    block_m = _block_m(max_seg_len)
    block_n = min(64, next_pow2(max(16, rank)))
    block_k = 32 if is_interpreted() else 128
    grid_mn = (num_segments, triton.cdiv(max_seg_len, block_m), triton.cdiv(rank, block_n))
    if split_k is None:
        split_k = _shrink_split_k(grid_mn[0] * grid_mn[1] * grid_mn[2], k, block_k, x.device)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    _lora_shrink_kernel[(grid_mn[0], grid_mn[1], grid_mn[2] * split_k)](
        x, lora_a, h, sorted_rows, seg_start, seg_slot,
        *x.stride(), *lora_a.stride(), *h.stride(),
        k, rank, k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        DOT_FP32=x.dtype == torch.float32 or x.device.type != "cuda",
        num_warps=4,
    )
    return h


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, sorted_rows: torch.Tensor,
                seg_start: torch.Tensor, seg_slot: torch.Tensor, max_seg_len: int,
                out: torch.Tensor, h_offset: int = 0) -> None:
    """In place: out[t] += (h[t, h_offset:h_offset + R] @ lora_b[seg_slot[g]].T).to(out.dtype) for the rows
    t of each segment g; rows in no segment are untouched.

    h [T, >= h_offset + R] float32 (from ``lora_shrink``); lora_b [S, N, R]; out [T, N] in the model dtype,
    any strides (a column slice of a wider tensor, a transposed view).
    """
    if h.dim() != 2 or lora_b.dim() != 3 or out.dim() != 2:
        raise ValueError(f"h must be [T, R], lora_b [S, N, R] and out [T, N], got shapes {tuple(h.shape)}, "
                         f"{tuple(lora_b.shape)}, {tuple(out.shape)}")
    num_slots, n, rank = lora_b.shape
    num_rows = out.shape[0]
    if h.dtype != torch.float32:
        raise ValueError(f"h must be float32 (from lora_shrink), got {h.dtype}")
    if h.shape[0] != num_rows or out.shape[1] != n:
        raise ValueError(f"out must be [T={h.shape[0]}, N={n}], got {tuple(out.shape)}")
    if h_offset < 0 or h.shape[1] < h_offset + rank:
        raise ValueError(f"h has {h.shape[1]} columns, h_offset={h_offset} + R={rank} do not fit")
    _check_segments(num_rows, num_slots, sorted_rows, seg_start, seg_slot, max_seg_len)
    _check_same_device(h=h, lora_b=lora_b, out=out, sorted_rows=sorted_rows, seg_start=seg_start,
                       seg_slot=seg_slot)
    _check_launchable(out)
    num_segments = seg_slot.shape[0]
    if num_segments == 0 or max_seg_len == 0 or rank == 0 or n == 0 or num_rows == 0:
        return
    block_m = _block_m(max_seg_len)
    block_n = 32 if is_interpreted() else 64
    block_r = min(64, next_pow2(max(16, rank)))
    grid = (num_segments, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n))
    _lora_expand_kernel[grid](
        h, lora_b, out, sorted_rows, seg_start, seg_slot,
        *h.stride(), *lora_b.stride(), *out.stride(),
        n, rank, h_offset,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        DOT_IEEE=out.dtype == torch.float32 or out.device.type != "cuda",
        num_warps=4,
    )


# ------------------------------------------------------------------------------------------ torch reference


def _segments(seg_start: torch.Tensor, seg_slot: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, slot) per segment, on the host."""
    starts = seg_start.tolist()
    return [(starts[g], starts[g + 1], slot) for g, slot in enumerate(seg_slot.tolist())]


def lora_shrink_reference(x: torch.Tensor, lora_a: torch.Tensor, sorted_rows: torch.Tensor,
                          seg_start: torch.Tensor, seg_slot: torch.Tensor,
                          max_seg_len: int | None = None) -> torch.Tensor:
    """``lora_shrink`` in torch (fp32 matmuls, one per segment); ``max_seg_len`` is not needed."""
    h = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    for start, end, slot in _segments(seg_start, seg_slot):
        if end > start:
            rows = sorted_rows[start:end].long()
            h.index_copy_(0, rows, x.index_select(0, rows).float() @ lora_a[slot].float().T)
    return h


def lora_expand_reference(h: torch.Tensor, lora_b: torch.Tensor, sorted_rows: torch.Tensor,
                          seg_start: torch.Tensor, seg_slot: torch.Tensor, max_seg_len: int | None,
                          out: torch.Tensor, h_offset: int = 0) -> None:
    """``lora_expand`` in torch (fp32 matmuls, one per segment, index_add_ into ``out`` in place)."""
    rank = lora_b.shape[2]
    for start, end, slot in _segments(seg_start, seg_slot):
        if end > start:
            rows = sorted_rows[start:end].long()
            delta = h.index_select(0, rows)[:, h_offset:h_offset + rank] @ lora_b[slot].float().T
            out.index_add_(0, rows, delta.to(out.dtype))
