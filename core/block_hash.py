"""Prefix-cache keys: a chain of hashes over full blocks only.

``hash(parent_hash, block tokens, extra_keys)``: a block's key depends on everything before it, so
equal keys mean equal prefixes. Python's tuple hash of ints is stable within a process, which is
all a cache needs (keys are never persisted); 64-bit collisions are ignored, as in vLLM's default.
"""

from __future__ import annotations

from twinserve.core.request import LazyTokenIds, Request

ROOT_HASH = 0x5EED
# A block's extra key without an adapter. Not None: before Python 3.12 ``hash(None)`` is derived
# from None's address, which differs between processes, and a data-parallel front hashes prompts
# in its own process to match the keys its replicas' events carry.
NO_LORA_KEY = 0


def update_block_hashes(request: Request, block_size: int, num_tokens: int) -> list[int]:
    """Extends ``request.block_hashes`` to cover the full blocks within ``num_tokens`` tokens.

    A ``LazyPrompt``'s full blocks take the keys it carries (for this block size) in place of
    the chain over their ids; the blocks after them chain on from its last key, over the ids.
    (``_update_block_hashes_plain`` is the plain chain throughout.)"""
    hashes = request.block_hashes
    num_done = len(hashes)
    num_full = num_tokens // block_size
    tokens = request.all_token_ids
    if num_done < num_full and type(tokens) is LazyTokenIds \
            and tokens.prompt.key_block_size == block_size:
        keys = tokens.prompt.keys[num_done:num_full]
        if keys:
            extra = request.lora
            hashes += keys if extra is None else [hash((k, extra)) for k in keys]
            num_done = len(hashes)
    return _chain(request, block_size, num_done, num_full)


def _update_block_hashes_plain(request: Request, block_size: int, num_tokens: int) -> list[int]:
    """``update_block_hashes`` with every block chained over its ids, lazy prompts included
    (the reference: the keys of a ``LazyPrompt`` stand in for these hashes)."""
    return _chain(request, block_size, len(request.block_hashes), num_tokens // block_size)


def _chain(request: Request, block_size: int, num_done: int, num_full: int) -> list[int]:
    """Chains hashes over the ids of blocks ``num_done`` to ``num_full``."""
    hashes = request.block_hashes
    if num_done + 1 == num_full:  # one more block (a decode crossed a block boundary)
        start = num_done * block_size
        parent = hashes[-1] if hashes else ROOT_HASH
        lora = request.lora
        hashes.append(hash((parent, tuple(request.all_token_ids[start:start + block_size]),
                            NO_LORA_KEY if lora is None else lora)))
    elif num_done < num_full:
        parent = hashes[-1] if hashes else ROOT_HASH
        extra = NO_LORA_KEY if request.lora is None else request.lora
        # zip over one iterator, block_size times: the new blocks' token tuples, built in C.
        tokens = iter(request.all_token_ids[num_done * block_size:num_full * block_size])
        for block in zip(*(tokens,) * block_size):
            parent = hash((parent, block, extra))
            hashes.append(parent)
    return hashes
