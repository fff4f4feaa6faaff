"""Prefix-cache keys: a chain of hashes over full blocks only.

``hash(parent_hash, block tokens, extra_keys)``: a block's key depends on everything before it, so
equal keys mean equal prefixes. Python's tuple hash of ints is stable within a process, which is
all a cache needs (keys are never persisted); 64-bit collisions are ignored, as in vLLM's default.
"""

from __future__ import annotations

from twinserve.core.request import Request

ROOT_HASH = 0x5EED


def update_block_hashes(request: Request, block_size: int, num_tokens: int) -> list[int]:
    """Extends ``request.block_hashes`` to cover the full blocks within ``num_tokens`` tokens."""
    hashes = request.block_hashes
    num_done = len(hashes)
    num_full = num_tokens // block_size
    if num_done + 1 == num_full:  # one more block (a decode crossed a block boundary)
        start = num_done * block_size
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash((parent, tuple(request.all_token_ids[start:start + block_size]),
                            request.lora)))
    elif num_done < num_full:
        parent = hashes[-1] if hashes else ROOT_HASH
        extra = request.lora
        # zip over one iterator, block_size times: the new blocks' token tuples, built in C.
        tokens = iter(request.all_token_ids[num_done * block_size:num_full * block_size])
        for block in zip(*(tokens,) * block_size):
            parent = hash((parent, block, extra))
            hashes.append(parent)
    return hashes
