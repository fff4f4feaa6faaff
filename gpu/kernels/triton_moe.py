"""Triton grouped expert products for the mixture-of-experts MLP on CUDA (``gpu/layers/moe.py`` is the
CPU path and the reference).

The ``T x k`` (token, expert) choices are sorted by expert and each expert's rows padded to a
multiple of ``BLOCK_M`` (vLLM's ``moe_align_block_size``), so every ``BLOCK_M``-row tile of the
sorted rows belongs to one expert::

    sorted rows | e0 e0 e0 pad | e2 e2 e2 e2 | e2 pad pad pad | e5 ...     tile -> expert id
    tile        |     0       |      1      |       2        |  3

One launch of ``_grouped_matmul_kernel`` then computes ``out[r] = a[row(r)] @ W[expert(tile)].T``
for all tiles (grid: tiles x output blocks), reading the input rows through the sorted index (no
gathered copy) and, for the down projection, scaling each row by its routing weight. A forward
is two launches (gate/up, down) plus the SiLU-gate and one ``index_add_``.

The module imports without CUDA and without Triton; kernels launch on CUDA tensors, or on CPU
tensors when ``TRITON_INTERPRET=1`` was set before it was imported (the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twinserve.gpu.kernels.triton_support import (
    HAS_TRITON,
    check_launchable,
    kernel_is_interpreted,
    next_pow2,
    tl,
    triton,
)

if HAS_TRITON:

    @triton.jit
    def _grouped_matmul_kernel(
        a_ptr, w_ptr, out_ptr, rows_ptr, tile_expert_ptr, scale_ptr,
        num_rows, n_out, k_in,
        stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
    ):
        tile = tl.program_id(0)
        nb = tl.program_id(1)
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(rows_ptr + offs_m)  # -1: padding
        valid = rows >= 0
        rows64 = tl.where(valid, rows, 0).to(tl.int64)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_out
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_in
            a = tl.load(a_ptr + rows64[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=valid[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
                        + offs_k[:, None] * stride_wk,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [K, N]
            if DOT_FP32:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        if SCALE:
            acc *= tl.load(scale_ptr + offs_m, mask=valid, other=0.0)[:, None]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def is_interpreted() -> bool:
    return HAS_TRITON and kernel_is_interpreted(_grouped_matmul_kernel)


def align_by_expert(ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For expert ids ``[T, k]``: the flat choice index at each padded sorted row (``-1`` on
    padding), each tile's expert, and each choice's padded row (its position in the sorted rows)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    sorted_experts = flat[order]
    rank = torch.arange(flat.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[
        sorted_experts]
    dest = starts[sorted_experts] + rank  # padded row of each sorted choice
    total = int(padded.sum())
    choice_at_row = torch.full((total,), -1, dtype=torch.int32, device=ids.device)
    choice_at_row[dest] = order.to(torch.int32)
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=ids.device),
                                          padded // block_m).to(torch.int32)
    row_of_choice = torch.empty_like(dest)
    row_of_choice[order] = dest
    return choice_at_row, tile_expert, row_of_choice


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, rows: torch.Tensor,
                   tile_expert: torch.Tensor, scale: torch.Tensor | None = None,
                   block_m: int = 16) -> torch.Tensor:
    """``out[r] = a[rows[r]] @ w[tile_expert[r // block_m]].T`` (times ``scale[r]`` when given;
    zero where ``rows[r] < 0``): ``a [M, K]``, ``w [E, N, K]``, returns ``[len(rows), N]``."""
    check_launchable(a, "triton_moe", HAS_TRITON, is_interpreted())
    if w.dim() != 3 or w.shape[2] != a.shape[1]:
        raise ValueError(f"w must be [experts, out, {a.shape[1]}], got {tuple(w.shape)}")
    if rows.numel() % block_m or tile_expert.numel() * block_m != rows.numel():
        raise ValueError("rows must be padded to whole tiles of block_m, one expert per tile")
    n_out, k_in = w.shape[1], w.shape[2]
    out = torch.zeros((rows.numel(), n_out), dtype=a.dtype, device=a.device)
    if rows.numel() == 0:
        return out
    block_n = min(64, next_pow2(max(16, n_out)))
    block_k = min(64, next_pow2(max(16, k_in)))
    dot_fp32 = a.dtype == torch.float32 or a.device.type != "cuda"
    grid = (tile_expert.numel(), triton.cdiv(n_out, block_n))
    _grouped_matmul_kernel[grid](
        a, w, out, rows, tile_expert, out if scale is None else scale,
        rows.numel(), n_out, k_in, *a.stride(), *w.stride(), *out.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SCALE=scale is not None,
        DOT_FP32=dot_fp32)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, block_m: int = 16) -> torch.Tensor:
    """The routed experts' sum for ``x [T, H]`` with routing ``weights``/``ids [T, k]``:
    ``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, e = ids[t, j]."""
    top_k = ids.shape[1]
    choice_at_row, tile_expert, row_of_choice = align_by_expert(ids, w13.shape[0], block_m)
    token_at_row = torch.where(choice_at_row >= 0, choice_at_row // top_k, -1).to(torch.int32)
    gate_up = grouped_matmul(x, w13, token_at_row, tile_expert, block_m=block_m)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = F.silu(gate) * up
    valid = choice_at_row >= 0
    scale = torch.zeros(choice_at_row.numel(), dtype=torch.float32, device=x.device)
    scale[valid] = weights.reshape(-1)[choice_at_row[valid].long()].float()
    own_rows = torch.where(valid, torch.arange(valid.numel(), device=x.device), -1).to(torch.int32)
    down = grouped_matmul(hidden, w2, own_rows, tile_expert, scale, block_m)
    tokens = torch.arange(ids.numel(), device=x.device) // top_k
    return torch.zeros_like(x).index_add_(0, tokens, down[row_of_choice])
