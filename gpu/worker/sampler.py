"""Token sampling with vLLM semantics, batched across requests.

Order per row: the grammar's allowed tokens (constrained decoding, ``allowed``),
``allowed_token_ids`` (the others masked) and ``logit_bias`` (added), min_tokens (stop tokens
masked), penalties (repetition over prompt + output, frequency and presence over
output), then greedy argmax, or temperature -> min_p -> top_k ->
top_p -> a draw. Rows with ``logits_processors`` run them first, on the raw logits; rows
with ``bad_words`` mask each bad word's last token when the output ends with the rest of it.
Draws use the exponential-race trick ``argmax(p / q)``, ``q ~ Exp(1)``, with the
request's own ``torch.Generator`` when it has a seed. Logprobs come from the raw logits (vLLM v1).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from twinserve.core.logprobs import TokenLogprobs
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.worker.logprobs import token_logprobs


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class SamplingRow(Protocol):
    """What sampling reads of a request: a ``Request``, or one draft position of a verification
    entry (``rejection_sampler``), whose output then includes the drafts before it."""

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def eos_token_id(self) -> int | None: ...


@dataclass(slots=True, frozen=True)
class DraftPosition:
    """A request seen from a draft position: its output followed by the drafts before it."""

    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]
    eos_token_id: int | None


def sample(logits: torch.Tensor, requests: Sequence[SamplingRow],
           generators: list[torch.Generator | None],
           default_generator: torch.Generator,
           allowed: tuple[list[int], torch.Tensor] | None = None) -> SamplerOutput:
    """Sample one token per row of ``logits[N, V]`` (float32) for ``requests[N]``.

    ``allowed``: ``(rows, mask[len(rows), V] bool)``, the tokens a grammar allows in those rows
    (the other rows' logits are left as they are)."""
    params = [r.sampling_params for r in requests]
    raw = logits
    logits = process_logits(logits, requests, allowed)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        drawn = _draw(logits[idx], [params[i] for i in random_rows],
                      [generators[i] for i in random_rows], default_generator)
        tokens[idx] = drawn
    token_ids = tokens.tolist()
    return SamplerOutput(token_ids, _logprobs(raw, params, token_ids))


def process_logits(logits: torch.Tensor, requests: Sequence[SamplingRow],
                   allowed: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
    """The logits greedy decoding takes the argmax of: grammar masks, token filters, bad words,
    min_tokens and penalties applied (a copy when anything applies)."""
    params = [r.sampling_params for r in requests]
    constrained: frozenset[int] = frozenset()
    if allowed is not None:
        rows, mask = allowed
        constrained = frozenset(rows)
        logits = logits.clone()
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~mask.to(logits.device, non_blocking=True),
                                              float("-inf"))
    if any(_needs_processing(p, r) for p, r in zip(params, requests)):
        if allowed is None:
            logits = logits.clone()
        for row, (p, r) in enumerate(zip(params, requests)):
            if p.logits_processors:
                _apply_logits_processors(logits, row, p, r)
            _apply_token_filters(logits[row], p)
            if p.bad_words_token_ids:
                _apply_bad_words(logits[row], p.bad_words_token_ids, r.output_token_ids)
            _apply_min_tokens(logits[row], p, r, row in constrained)
            _apply_penalties(logits[row], p, r)
    return logits


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, min_p, top-k, top-p, softmax."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temps[:, None]
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        probs = torch.softmax(logits, dim=-1)
        cutoff = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
        logits = logits.masked_fill(probs < cutoff, float("-inf"))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    return torch.softmax(logits, dim=-1)


def _needs_processing(p: SamplingParams, r: SamplingRow) -> bool:
    return (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0 or len(r.output_token_ids) < p.min_tokens
            or p.logit_bias is not None or p.allowed_token_ids is not None
            or p.bad_words_token_ids is not None or p.logits_processors is not None)


def _apply_logits_processors(logits: torch.Tensor, row: int, p: SamplingParams,
                             r: SamplingRow) -> None:
    """vLLM v0's logits processors on one row: ``fn(output_ids, logits)`` or ``fn(prompt_ids,
    output_ids, logits)`` (by the number of parameters), each returning the new row."""
    for fn in p.logits_processors or ():
        output = list(r.output_token_ids)
        if _num_params(fn) == 3:
            new = fn(list(r.prompt_token_ids), output, logits[row])
        else:
            new = fn(output, logits[row])
        if not isinstance(new, torch.Tensor) or new.shape != logits[row].shape:
            raise ValueError(f"logits processor {fn!r} must return a tensor of shape "
                             f"{tuple(logits[row].shape)}, got {type(new).__name__}.")
        logits[row] = new


def _num_params(fn: object) -> int:
    try:
        return len(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 2


def _apply_bad_words(row: torch.Tensor, bad_words: list[list[int]], output: list[int]) -> None:
    """vLLM's ``apply_bad_words``: a bad word's last token is masked when the tokens before it
    are the output's last tokens (a one-token bad word is always masked)."""
    banned = []
    num_out = len(output)
    for ids in bad_words:
        prefix = len(ids) - 1
        if prefix > num_out:
            continue
        if prefix == 0 or output[num_out - prefix:] == ids[:prefix]:
            banned.append(ids[-1])
    if banned:
        row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")


def _apply_token_filters(row: torch.Tensor, p: SamplingParams) -> None:
    """vLLM's allowed-token-ids mask, then its logit bias, on one row in place."""
    if p.allowed_token_ids is not None:
        keep = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=row.device)
        kept = row[keep].clone()
        row.fill_(float("-inf"))
        row[keep] = kept
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)


def _apply_min_tokens(row: torch.Tensor, p: SamplingParams, r: SamplingRow,
                      constrained: bool = False) -> None:
    if len(r.output_token_ids) >= p.min_tokens:
        return
    banned = list(p.stop_token_ids)
    if r.eos_token_id is not None and not p.ignore_eos:
        banned.append(r.eos_token_id)
    if banned:
        idx = torch.tensor(banned, dtype=torch.long, device=row.device)
        kept = row[idx].clone() if constrained else None
        row[idx] = float("-inf")
        if kept is not None and bool(torch.isinf(row).all()):
            row[idx] = kept  # the grammar is complete: it wins over min_tokens


def _apply_penalties(row: torch.Tensor, p: SamplingParams, r: SamplingRow) -> None:
    """vLLM's ``apply_penalties`` on one row, in place."""
    vocab = row.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[torch.tensor([*r.prompt_token_ids, *r.output_token_ids], device=row.device)] = True
        penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, penalised, row))
    if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and r.output_token_ids:
        out = torch.tensor(r.output_token_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
        row.sub_(p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype))


def _draw(logits: torch.Tensor, params: list[SamplingParams],
          generators: list[torch.Generator | None],
          default_generator: torch.Generator) -> torch.Tensor:
    probs = target_probs(logits, params)
    q = torch.empty_like(probs)
    for row, gen in enumerate(generators):
        q[row].exponential_(generator=gen or default_generator)
    return probs.div_(q).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask all but the top k, then the smallest set whose probability reaches top_p."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                         device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs      # keep a token while the mass before it < p
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def _logprobs(raw: torch.Tensor, params: list[SamplingParams],
              token_ids: list[int]) -> list[TokenLogprobs | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    idx = torch.tensor(rows, dtype=torch.long, device=raw.device)
    computed = token_logprobs(raw[idx], [token_ids[i] for i in rows],
                              [params[i].logprobs or 0 for i in rows])
    for i, entry in zip(rows, computed):
        result[i] = entry
    return result
