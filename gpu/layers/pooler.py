"""Pooling for embedding requests (vLLM's embed task on a decoder model): the final, normed
hidden state of the last prompt token, in float32, L2-normalised unless asked otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twinserve.core.pooling_params import PoolingParams


def pooled_state(last_hidden: torch.Tensor, params: PoolingParams) -> list[float]:
    """``last_hidden[H]``: the last prompt position's row of the model's output."""
    state = last_hidden.float()
    if params.normalize:
        state = F.normalize(state, p=2.0, dim=-1)
    return state.tolist()
