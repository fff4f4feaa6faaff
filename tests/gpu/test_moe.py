"""The expert-grouped MoE path (gpu/layers/moe.py) against its plain per-token reference, and the router
against HF's (softmax, top-k, optional renormalisation)."""

from __future__ import annotations

import pytest
import torch

from twinserve.core.architectures import MoEFields
from twinserve.gpu.layers.moe import SparseMoE


def _moe(experts: int, k: int, renormalize: bool, dtype: torch.dtype = torch.float32,
         hidden: int = 24, inter: int = 20) -> SparseMoE:
    torch.manual_seed(1)
    moe = SparseMoE(MoEFields(experts, k, inter, renormalize), hidden, dtype, torch.device("cpu"))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).to(dtype) * 0.3)
    return moe


@pytest.mark.parametrize(("experts", "k", "renormalize", "tokens"),
                         [(4, 2, True, 1), (4, 2, False, 9), (8, 3, True, 64), (6, 1, False, 17),
                          (3, 3, True, 5)])
def test_grouped_experts_equal_the_per_token_loop(experts: int, k: int, renormalize: bool,
                                                  tokens: int) -> None:
    moe = _moe(experts, k, renormalize)
    x = torch.randn(tokens, 24, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        torch.testing.assert_close(moe(x), moe.forward_reference(x), rtol=1e-5, atol=1e-5)


def test_grouped_experts_in_bf16_stay_close_to_the_reference() -> None:
    moe = _moe(8, 2, True, torch.bfloat16)
    x = torch.randn(32, 24).to(torch.bfloat16)
    with torch.inference_mode():
        got, want = moe(x).float(), moe.forward_reference(x).float()
    assert float((got - want).abs().max()) < 3e-2


def test_the_router_picks_the_top_k_and_renormalises_only_when_asked() -> None:
    x = torch.randn(10, 24, generator=torch.Generator().manual_seed(0))
    for renormalize in (True, False):
        moe = _moe(6, 2, renormalize)
        weights, ids = moe.route(x)
        probs = torch.softmax(x @ moe.router.t(), dim=-1)
        top, top_ids = probs.topk(2, dim=-1)
        assert torch.equal(ids, top_ids)
        expected = top / top.sum(-1, keepdim=True) if renormalize else top
        torch.testing.assert_close(weights, expected)


def test_expert_tensors_load_into_their_stacked_rows() -> None:
    moe = _moe(3, 1, True, hidden=4, inter=2)
    gate, up, down = torch.ones(2, 4), 2 * torch.ones(2, 4), 3 * torch.ones(4, 2)
    moe.load_expert(moe.w13, gate, 2 * 1)
    moe.load_expert(moe.w13, up, 2 * 1 + 1)
    moe.load_expert(moe.w2, down, 1)
    assert torch.equal(moe.w13[1], torch.cat([gate, up])) and torch.equal(moe.w2[1], down)
