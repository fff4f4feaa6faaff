"""What the engine does to a request's prompt and parameters before queuing it, for the
request-surface extras: ``truncate_prompt_tokens`` (keep the last k tokens), ``bad_words``
(tokenized here), embedding requests (``PoolingParams``: one prompt, prefill only), and finite
sampling numbers (an infinite ``temperature`` or ``repetition_penalty`` would sample noise or
NaNs; the server also bounds ``temperature`` at OpenAI's 2, the Python API as vLLM's does not)."""

from __future__ import annotations

import math

from twinserve.core.pooling_params import PoolingParams
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.engine.tokenizer import Tokenizer

FINITE_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")


class RequestSurface:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int,
                 hidden_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.hidden_size = hidden_size

    def prepare(self, token_ids: list[int], params: SamplingParams,
                pooling: PoolingParams | None) -> list[int]:
        """The prompt as the engine queues it; raises ValueError naming a bad field."""
        for name in FINITE_FIELDS:
            value = getattr(params, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}.")
        if pooling is not None:
            pooling.validate()
            self._check_pooling(params, pooling)
            token_ids = truncate_prompt(token_ids, pooling.truncate_prompt_tokens,
                                        self.max_model_len, "truncate_prompt_tokens")
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens,
                                    self.max_model_len, "truncate_prompt_tokens")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words needs the model's tokenizer.json.")
            tokenizer = self.tokenizer
            params.update_from_tokenizer(
                lambda text: tokenizer.encode(text, add_special_tokens=False))
        else:
            params.bad_words_token_ids = None
        return token_ids

    def _check_pooling(self, params: SamplingParams, pooling: PoolingParams) -> None:
        if pooling.dimensions is not None and pooling.dimensions != self.hidden_size:
            raise ValueError(f"dimensions: this model does not support Matryoshka embeddings; "
                             f"its embeddings have {self.hidden_size} dimensions, got "
                             f"{pooling.dimensions}.")
        if params.n != 1 or params.max_tokens != 1:
            raise ValueError("an embedding request samples nothing: use "
                             "SamplingParams(max_tokens=1) (LLM.embed does).")


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int,
                    field_name: str) -> list[int]:
    """The last ``keep`` tokens (-1: the last ``max_model_len - 1``, leaving room for one
    generated token); None keeps them all."""
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len - 1
    if keep > max_model_len:
        raise ValueError(f"{field_name} ({keep}) must be at most max_model_len "
                         f"({max_model_len}).")
    return token_ids[-keep:] if len(token_ids) > keep else token_ids
