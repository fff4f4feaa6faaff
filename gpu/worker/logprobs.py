"""Logprobs of chosen tokens from a batch of logits: the chosen token's log-softmax value, its
rank (vLLM's: how many tokens have a logprob >= it) and the top-k, as ``TokenLogprobs``.

Used for the sampled tokens (one row per request) and for prompt logprobs (one row per prompt
position, the chosen token being the prompt's next token), in slices of rows so that a long
prompt chunk never holds more than ``MAX_ROWS x vocab`` float32 at once.
"""

from __future__ import annotations

import torch

from twinserve.core.logprobs import TokenLogprobs

MAX_ROWS = 256  # 256 x 152k vocab x 4 B = 156 MB per slice at most


def token_logprobs(logits: torch.Tensor, token_ids: list[int],
                   num_top: list[int]) -> list[TokenLogprobs]:
    """For each row ``i`` of ``logits[N, V]``: ``token_ids[i]``'s logprob and rank and the
    ``num_top[i]`` most likely tokens."""
    result: list[TokenLogprobs] = []
    for lo in range(0, logits.shape[0], MAX_ROWS):
        hi = min(lo + MAX_ROWS, logits.shape[0])
        result.extend(_slice(logits[lo:hi], token_ids[lo:hi], num_top[lo:hi]))
    return result


def _slice(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=lp.device)[:, None]
    chosen = lp.gather(1, ids)
    ranks = (lp >= chosen).sum(dim=-1).tolist()
    k = max(num_top)
    if k:
        top_vals, top_ids = lp.topk(k, dim=-1)
        vals, tops = top_vals.tolist(), top_ids.tolist()
    else:
        vals = tops = [[] for _ in token_ids]
    return [TokenLogprobs(token_ids[i], c, ranks[i], tops[i][:num_top[i]], vals[i][:num_top[i]])
            for i, c in enumerate(chosen[:, 0].tolist())]


def prompt_targets(all_token_ids: list[int], start: int, end: int) -> list[int]:
    """The tokens that positions ``[start, end)`` predict: position p predicts token p + 1."""
    return all_token_ids[start + 1:end + 1]
