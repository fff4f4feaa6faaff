"""What the quantized-model tests share: two runs agree when their greedy tokens are equal and
their sampled tokens' log-probabilities are within LOGPROB_TOL (accumulation order differs)."""

from __future__ import annotations

import numpy as np

LOGPROB_TOL = 2e-3


def assert_close_runs(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        lp_x = [next(iter(step.values())).logprob for step in x.logprobs]
        lp_y = [next(iter(step.values())).logprob for step in y.logprobs]
        assert np.allclose(lp_x, lp_y, atol=LOGPROB_TOL, rtol=0)
