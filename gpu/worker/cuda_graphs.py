"""CUDA-only helpers: memory profiling for the KV budget and CUDA graphs of uniform steps.

A decode-only step (every sequence adds one token) has a shape fixed by its batch size, so the
forward is captured once per size in ``_CAPTURE_SIZES`` over static input buffers; a step copies its
inputs into the buffers of the next captured size up, pads the rest (slot -1: no KV write; a one-token
context in block 0 whose output is discarded) and replays. Triton kernels only (no host syncs).

A verification step of speculative decoding where every sequence verifies the same k drafts (1 + k
queries each, vLLM's uniform spec-decode batch of FULL_DECODE_ONLY) is fixed by (batch size, k) in
the same way: ``verify_ks`` names the k captured (the configured ``num_speculative_tokens``), each
at the batch sizes whose 1 + k queries per sequence fit the largest decode capture. Padding
sequences get 1 + k queries over a (1 + k)-token context in block 0, slots -1. Any other step (mixed
query lengths, another k, a prefill) runs eagerly (``graph_key``: None).
"""

from __future__ import annotations

import torch

from twinserve.gpu.layers.attention_backend import AttentionMetadata
from twinserve.gpu.models.model import CausalLM, KVCache
from twinserve.gpu.worker.batch import ModelInput

_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def dummy_prefill(num_tokens: int, max_len: int, block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, AttentionMetadata, int]:
    """Positions and metadata of a prefill step of ``num_tokens`` tokens as prompts of at most
    ``max_len`` tokens each (a step's token budget may exceed the model length, and no position
    may pass it), each prompt in blocks of its own; and the number of blocks they take."""
    full, rest = divmod(num_tokens, max_len)
    lengths = [max_len] * full + ([rest] if rest else [])
    per_seq = -(-max(lengths) // block_size)
    tables = torch.arange(len(lengths) * per_seq, dtype=torch.int32).view(len(lengths), per_seq)
    positions = torch.cat([torch.arange(n) for n in lengths])
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    slots = tables[owner, positions // block_size].long() * block_size + positions % block_size
    starts = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=tables.to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device), max_query_len=max(lengths), max_seq_len=max(lengths))
    return positions.to(device), meta, tables.numel()


def profile_peak_memory(model: CausalLM, num_tokens: int, block_size: int, max_len: int) -> int:
    """Bytes held at the peak of one forward over ``num_tokens`` prefill tokens (weights included),
    in prompts of at most ``max_len`` tokens, run against a throwaway KV cache."""
    device = next(model.parameters()).device
    config = model.config
    positions, meta, num_blocks = dummy_prefill(num_tokens, max_len, block_size, device)
    kv_heads = model.layers[0].num_kv_heads  # this rank's, under tensor parallelism
    shape = (num_blocks, block_size, kv_heads, config.head_dim)
    dtype = model.embed_tokens.dtype
    caches = [(torch.empty(shape, dtype=dtype, device=device),
               torch.empty(shape, dtype=dtype, device=device))
              for _ in range(config.num_hidden_layers)]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        hidden = model(torch.zeros(num_tokens, dtype=torch.long, device=device), positions,
                       caches, meta)
        model.compute_logits(hidden[-256:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - sum(k.nbytes + v.nbytes for k, v in caches)
    del caches, hidden
    torch.cuda.empty_cache()
    return peak


def graph_key(num_tokens: int, num_seqs: int, max_query_len: int,
              verify_ks: tuple[int, ...]) -> tuple[int, int] | None:
    """``(padded batch size, queries per sequence)`` of the graph that runs a step, None when
    no captured graph does: a decode-only step (1 query each, at most ``_CAPTURE_SIZES[-1]``
    sequences) or a uniform one of 1 + k queries each with k in ``verify_ks`` (its tokens at
    most ``_CAPTURE_SIZES[-1]``). A batch is uniform when its longest query times its sequences
    is its token count."""
    if num_seqs <= 0 or num_tokens != num_seqs * max_query_len:
        return None
    queries = max_query_len
    if queries != 1 and queries - 1 not in verify_ks:
        return None
    size = next((s for s in _CAPTURE_SIZES if s >= num_seqs), None)
    if size is None or (queries > 1 and size * queries > _CAPTURE_SIZES[-1]):
        return None
    return size, queries


def capture_keys(verify_ks: tuple[int, ...]) -> list[tuple[int, int]]:
    """Every ``(batch size, queries per sequence)`` captured: the decode sizes, then each
    verified k at the sizes whose tokens fit the largest decode capture."""
    keys = [(size, 1) for size in _CAPTURE_SIZES]
    for k in verify_ks:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"verify_ks must hold integers >= 1, got {k!r}.")
        keys += [(size, 1 + k) for size in _CAPTURE_SIZES if size * (1 + k) <= _CAPTURE_SIZES[-1]]
    return keys


class DecodeGraphs:
    """Captured forwards of uniform steps keyed by ``(padded batch size, queries per sequence)``:
    decodes, and verifications of each k in ``verify_ks``."""

    def __init__(self, model: CausalLM, kv_caches: list[KVCache], block_size: int,
                 max_model_len: int, verify_ks: tuple[int, ...] = ()) -> None:
        device = next(model.parameters()).device
        self.model = model
        self.max_blocks = -(-max_model_len // block_size)
        self.verify_ks = tuple(sorted(set(verify_ks)))
        n = _CAPTURE_SIZES[-1]  # tokens and sequences of the largest capture
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        # one query_start_loc per query count: 0, q, 2q, ...
        self.query_starts = {q: torch.arange(0, q * n + 1, q, dtype=torch.int32, device=device)
                             for _, q in capture_keys(self.verify_ks)}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        with torch.inference_mode():
            for key in sorted(capture_keys(self.verify_ks), key=lambda kq: -kq[0] * kq[1]):
                graph, out = self._capture(key, kv_caches, pool)
                pool = graph.pool()
                self.graphs[key] = (graph, out)

    def _meta(self, size: int, queries: int) -> AttentionMetadata:
        tokens = size * queries
        return AttentionMetadata(self.slot_mapping[:tokens], self.block_tables[:size],
                                 self.seq_lens[:size], self.query_starts[queries][:size + 1],
                                 max_query_len=queries, max_seq_len=queries)

    def _capture(self, key: tuple[int, int], kv_caches: list[KVCache],
                 pool: object) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        size, queries = key
        tokens = size * queries
        self.seq_lens[:size].fill_(queries)  # every padded context holds its queries
        args = (self.input_ids[:tokens], self.positions[:tokens], kv_caches,
                self._meta(size, queries))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model(*args)  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.model(*args)
        return graph, out

    def key(self, inputs: ModelInput) -> tuple[int, int] | None:
        """The captured graph that runs ``inputs`` (``graph_key``), None: run eagerly."""
        meta = inputs.meta
        if meta.block_tables.shape[1] > self.max_blocks:
            return None
        return graph_key(inputs.input_ids.shape[0], meta.seq_lens.shape[0],
                         meta.max_query_len, self.verify_ks)

    def can_run(self, inputs: ModelInput) -> bool:
        return self.key(inputs) in self.graphs

    def run(self, inputs: ModelInput) -> torch.Tensor:
        key = self.key(inputs)
        if key is None or key not in self.graphs:
            raise ValueError("no captured graph runs this step (can_run is False).")
        size, queries = key
        num_tokens = inputs.input_ids.shape[0]
        num_seqs = num_tokens // queries
        padded = size * queries
        meta = inputs.meta
        self.input_ids[:num_tokens].copy_(inputs.input_ids)
        self.positions[:num_tokens].copy_(inputs.positions)
        self.positions[num_tokens:padded].zero_()
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        self.slot_mapping[num_tokens:padded].fill_(-1)
        self.block_tables[:num_seqs, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.block_tables[num_seqs:size].zero_()
        self.seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.seq_lens[num_seqs:size].fill_(queries)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:num_tokens]
