"""Log-probabilities in vLLM's shape: ``Logprob(logprob, rank, decoded_token)`` objects, one dict
``{token_id: Logprob}`` per position.

Across the step seam a position travels as ``TokenLogprobs``: the chosen token's logprob and
rank (1 = the most likely token; vLLM counts the tokens whose logprob is >= the chosen one's)
and the top-k candidates in rank order. The front-ends turn them into dicts that always hold
the chosen token (the sampled one, or the prompt's next token), after the top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """vLLM's ``Logprob``: the log-probability of a token, its rank in the vocabulary (1 = the
    most likely) and the token as text (None when the output is not detokenized)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class TokenLogprobs:
    """One position's logprobs as the backend computed them: ``token_id`` is the chosen token
    (sampled, or the prompt's next token), ``top_ids``/``top_logprobs`` the k most likely."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]

    def as_dict(self, decode: Callable[[int], str] | None = None) -> dict[int, Logprob]:
        """``{token_id: Logprob}``: the top-k in rank order, then the chosen token if it is not
        among them (so it is always there)."""
        out: dict[int, Logprob] = {}
        for rank, (token, value) in enumerate(zip(self.top_ids, self.top_logprobs), start=1):
            out[token] = Logprob(value, rank, decode(token) if decode else None)
        if self.token_id not in out:
            out[self.token_id] = Logprob(self.logprob, self.rank,
                                         decode(self.token_id) if decode else None)
        return out


SampleLogprobs = list[dict[int, Logprob]]
# The first prompt token has no logprob (nothing precedes it): its entry is None, as in vLLM.
PromptLogprobs = list[dict[int, Logprob] | None]
