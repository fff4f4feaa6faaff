"""A dense fp32 reference of paged attention (causal, sliding window, soft-capping) and random
paged batches, shared by the torch, C++ and Triton attention tests."""

import torch


def ref_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                        window=None, softcap=None):
    """Dense fp32 reference: gather each sequence's K/V via its block table, causal mask (and sliding
    window: keys > query position - window), optional tanh soft-capping, softmax."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float32)
    for b in range(seq_lens.shape[0]):
        seq_len = int(seq_lens[b])
        q0, q1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        n_pages = -(-seq_len // block_size)
        pages = block_tables[b, :n_pages].long()
        k = key_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = value_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = seq_len - (q1 - q0) + torch.arange(q1 - q0)
        causal = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        if window is not None:
            causal &= torch.arange(seq_len)[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~causal[None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out


def make_batch(seq_lens, query_lens, *, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
               dtype=torch.float32, extra_blocks=5, seed=0, device="cpu"):
    """Random caches with every sequence's pages drawn from a shuffled pool (non-contiguous block tables)."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_pages = max(pages_per_seq) + 1
    block_tables = torch.zeros((len(seq_lens), max_pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_per_seq):
        block_tables[b, :n] = perm[start:start + n].int()
        block_tables[b, n:] = perm[-1].int()  # padding entries point at an unused block
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    num_tokens = sum(query_lens)
    query = torch.randn((num_tokens, num_q_heads, head_dim), generator=g).to(dtype)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    batch = dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                 query_start_loc=torch.tensor(qsl, dtype=torch.int32))
    batch = {k: v.to(device) for k, v in batch.items()}
    batch["scale"] = head_dim ** -0.5
    return batch
