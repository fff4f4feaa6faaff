"""Verification of speculative drafts: from the target's logits at the 1 + k positions of a
verification entry, the accepted drafts followed by one token (recovered or bonus).

Methods (vLLM's ``rejection_sample_method``):
- ``strict``: accept while the draft is the target's argmax, then the argmax (greedy requests use
  it under every method but ``synthetic``: identical to decoding without speculation);
- ``probabilistic`` (Leviathan et al. 2023; Chen et al. 2023): accept draft d at position j with
  probability min(1, p_j(d) / q_j(d)), where p is the target's distribution after the request's
  sampling parameters and q the distribution d was drawn from; on rejection draw from
  norm(max(0, p_j - q_j)); when all k are accepted draw the bonus token from p_k. Drafts without
  probabilities (ngram, suffix) have a one-hot q: accept with p_j(d), else draw from p_j with d
  removed. The emitted tokens then follow the target's distribution exactly;
- ``synthetic``: accept position j with the given rate, independent of the tokens, stopping at
  the first rejection; the last token is drawn from the target. For calibrating acceptance
  only: the drafts accepted are not the model's tokens.

Draws use the request's own generator when it has a seed (otherwise the runner's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

METHODS = ("strict", "probabilistic", "synthetic")


@dataclass(slots=True, frozen=True)
class VerifySettings:
    """How drafts are verified; ``synthetic_acceptance_rate``: one rate per draft position (the
    last one repeats for positions past the list)."""

    method: str = "probabilistic"
    synthetic_acceptance_rate: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"rejection_sample_method must be one of {METHODS}, "
                             f"got {self.method!r}.")
        if self.method == "synthetic" and not self.synthetic_acceptance_rate:
            raise ValueError("synthetic_acceptance_rate is required with "
                             "rejection_sample_method 'synthetic'.")
        for rate in self.synthetic_acceptance_rate:
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"synthetic_acceptance_rate must lie in [0, 1], got {rate!r}.")

    def rate(self, position: int) -> float:
        rates = self.synthetic_acceptance_rate
        return rates[min(position, len(rates) - 1)]


def verify(settings: VerifySettings, greedy: bool, drafts: Sequence[int], logits: torch.Tensor,
           probs: torch.Tensor | None, draft_probs: torch.Tensor | None,
           generator: torch.Generator) -> list[int]:
    """The emitted tokens (1 .. k + 1) for one verification entry.

    ``logits[k + 1, V]``: the target's logits after the request's penalties and filters (what
    greedy decoding takes the argmax of); ``probs[k + 1, V]``: its sampling distribution
    (temperature, top-k/p, min-p), None for a greedy request; ``draft_probs[k, V]``: the
    distribution each draft was drawn from, None for drafts without one (one-hot)."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"verification needs {k + 1} rows of logits, got {logits.shape[0]}.")
    if settings.method == "synthetic":
        accepted = _synthetic_accepted(settings, k, generator)
        last = logits[accepted].argmax().item() if greedy else _draw(probs[accepted], generator)
        return [*drafts[:accepted], int(last)]
    if greedy:  # every method but synthetic: strict
        return _strict(drafts, logits)
    if probs is None:
        raise ValueError("probabilistic verification of a sampled request needs its probs.")
    return _probabilistic(drafts, probs, draft_probs, generator)


def _strict(drafts: Sequence[int], logits: torch.Tensor) -> list[int]:
    return strict_accept(drafts, logits.argmax(dim=-1).tolist())


def strict_accept(drafts: Sequence[int], best: Sequence[int]) -> list[int]:
    """``strict`` from the target's argmax at the 1 + k positions (``best``): the drafts while
    each equals the argmax before it, then the argmax where the first one differs (or the
    bonus token)."""
    if len(best) != len(drafts) + 1:
        raise ValueError(f"verification needs {len(drafts) + 1} argmax tokens, got {len(best)}.")
    out: list[int] = []
    for draft, target in zip(drafts, best):
        out.append(target)
        if draft != target:
            return out
    out.append(best[len(drafts)])
    return out


def _probabilistic(drafts: Sequence[int], probs: torch.Tensor, draft_probs: torch.Tensor | None,
                   generator: torch.Generator) -> list[int]:
    uniforms = torch.rand(len(drafts), generator=generator, device=probs.device,
                          dtype=torch.float64).tolist()
    out: list[int] = []
    for j, draft in enumerate(drafts):
        p = probs[j]
        p_draft = float(p[draft])
        q_draft = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        if q_draft > 0.0 and uniforms[j] < min(1.0, p_draft / q_draft):
            out.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: rejection had probability 0 (rounding)
            residual = p
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(probs[len(drafts)], generator))
    return out


def _synthetic_accepted(settings: VerifySettings, k: int, generator: torch.Generator) -> int:
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64,
                          device=generator.device).tolist()
    for j, u in enumerate(uniforms):
        if u >= settings.rate(j):
            return j
    return k


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token from unnormalised non-negative ``weights`` (the sampler's exponential race)."""
    q = torch.empty_like(weights, dtype=torch.float32).exponential_(generator=generator)
    return int((weights.float() / q).argmax())
