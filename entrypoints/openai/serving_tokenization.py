"""``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

from twinserve.entrypoints.openai.generation import check_model, refuse_unimplemented
from twinserve.entrypoints.openai.http_errors import APIError
from twinserve.entrypoints.openai.protocol import (
    TOKENIZE,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from twinserve.entrypoints.openai.server_state import ServerState
from twinserve.entrypoints.openai.serving_chat import chat_prompt


def tokenize(state: ServerState, body: TokenizeRequest) -> TokenizeResponse:
    check_model(state, body.model)
    refuse_unimplemented(body, TOKENIZE)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "Give exactly one of prompt or messages.", "prompt")
    if body.messages is not None:
        tokens = chat_prompt(state, body).token_ids
    else:
        tokens = state.tokenizer.encode(body.prompt or "",
                                        add_special_tokens=body.add_special_tokens)
    return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens)


def detokenize(state: ServerState, body: DetokenizeRequest) -> DetokenizeResponse:
    check_model(state, body.model)
    refuse_unimplemented(body, "detokenize")
    vocab = state.engine.runner.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens must be in [0, {vocab}), got {bad[0]}.", "tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))
