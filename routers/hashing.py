"""A prompt's block hashes as the replicas' prefix caches key them (``core.block_hash``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from twinserve.core.block_hash import NO_LORA_KEY, ROOT_HASH
from twinserve.core.request import LazyPrompt, Request


def prompt_block_hashes(request: Request, block_size: int) -> Iterable[int]:
    """The hashes of the prompt's full blocks, first to last, made as they are read (a router
    stops at its first miss). The same keys as ``core.block_hash.update_block_hashes``: a
    ``LazyPrompt``'s keys for this block size (as they are, its list or a slice of it, when
    they cover the prompt and no adapter salts them: read them, never change them), else the
    chain over the ids; the request is not changed."""
    prompt = request.prompt_token_ids
    num_full = request.num_prompt_tokens // block_size
    if isinstance(prompt, LazyPrompt) and prompt.key_block_size == block_size \
            and request.lora is None:
        keys = prompt.keys
        if len(keys) == num_full:
            return keys
        if len(keys) > num_full:
            return keys[:num_full]
    return _chained(request, block_size, num_full)


def _chained(request: Request, block_size: int, num_full: int) -> Iterator[int]:
    prompt = request.prompt_token_ids
    lora = request.lora
    done = 0
    parent = ROOT_HASH
    if isinstance(prompt, LazyPrompt) and prompt.key_block_size == block_size:
        for key in prompt.keys[:num_full]:
            parent = key if lora is None else hash((key, lora))
            yield parent
        done = min(len(prompt.keys), num_full)
    extra = NO_LORA_KEY if lora is None else lora
    for start in range(done * block_size, num_full * block_size, block_size):
        parent = hash((parent, tuple(prompt[start:start + block_size]), extra))
        yield parent
