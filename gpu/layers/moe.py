"""The mixture-of-experts MLP (``core/architectures/moe_base.py``) over a flattened batch.

``forward`` groups the tokens by expert: the ``T x k`` (token, expert) choices are sorted by
expert id once, so each expert a step touches runs one product over its rows (no per-token loop),
and the weighted outputs are added back per token with one ``index_add_``. ``forward_reference``
is the plain per-token, per-choice loop the grouped path is tested against. On CUDA the same
grouping runs as one Triton kernel launch per projection (``gpu/kernels/triton_moe.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twinserve.core.architectures import MoEFields
from twinserve.gpu.kernels.cpu_gemm import Gemm


class SparseMoE(nn.Module):
    """Router ``[E, hidden]``, experts' gate/up ``w13 [E, 2 * inter, hidden]`` and down
    ``w2 [E, hidden, inter]``; ``load_expert`` places one HF expert tensor (shard ``2 e`` / ``2 e
    + 1``: expert e's gate / up rows of ``w13``; shard ``e``: its ``w2``)."""

    def __init__(self, moe: MoEFields, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, gemm: Gemm | None = None) -> None:
        super().__init__()
        # the experts' products take the model's CPU GEMM paths (gpu/kernels/cpu_gemm.py), as its
        # dense projections do
        self.gemm = Gemm.for_device(device, dtype) if gemm is None else gemm
        experts, inter = moe.num_experts, moe.moe_intermediate_size
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        self.inter = inter
        self.router = _param(torch.empty(experts, hidden_size, dtype=dtype, device=device))
        self.w13 = _param(torch.empty(experts, 2 * inter, hidden_size, dtype=dtype, device=device))
        self.w2 = _param(torch.empty(experts, hidden_size, inter, dtype=dtype, device=device))
        for param in (self.w13, self.w2):
            param.weight_loader = self.load_expert  # type: ignore[attr-defined]

    def load_expert(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: int) -> None:
        if param is self.w13:
            expert, part = divmod(shard_id, 2)
            param.data[expert, part * self.inter:(part + 1) * self.inter].copy_(tensor)
        else:
            param.data[shard_id].copy_(tensor)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's router: softmax in float32 over all experts, the top ``k``, renormalised when
        the family says so; weights ``[T, k]`` in ``x``'s dtype and expert ids ``[T, k]``."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` (SiLU-gated) on rows ``x [n, hidden]``."""
        gate, up = self.gemm.linear(x, self.w13[e]).chunk(2, dim=-1)
        return self.gemm.linear(F.silu(gate) * up, self.w2[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Grouped by expert: one product per expert the batch touches (on CUDA: the Triton
        grouped kernel, one launch per projection)."""
        weights, ids = self.route(x)
        if x.is_cuda:
            from twinserve.gpu.kernels.triton_moe import fused_moe  # lazy: Triton only where it runs
            return fused_moe(x, self.w13, self.w2, weights, ids)
        if x.shape[0] == 1:  # one token: its k experts directly (sorting costs more than it saves)
            chosen = ids[0].tolist()
            out = self.expert(chosen[0], x).mul_(weights[0, 0])
            for j in range(1, self.top_k):
                out.add_(self.expert(chosen[j], x), alpha=float(weights[0, j]))
            return out
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        rows = order // self.top_k  # the token of each sorted choice
        grouped = x.index_select(0, rows)
        out_rows = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out_rows[start:start + n] = self.expert(e, grouped[start:start + n])
                start += n
        out_rows.mul_(weights.reshape(-1, 1).index_select(0, order))
        return torch.zeros_like(x).index_add_(0, rows, out_rows)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The plain version: every token's every choice through its expert, one at a time."""
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(self.top_k):
                out[t] += weights[t, j] * self.expert(int(ids[t, j]), x[t:t + 1])[0]
        return out


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
