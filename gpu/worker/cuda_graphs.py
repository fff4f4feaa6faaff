"""CUDA-only helpers: memory profiling for the KV budget and CUDA graphs of decode-only steps.

A decode-only step (every sequence adds one token) has a shape fixed by its batch size, so the
forward is captured once per size in ``_CAPTURE_SIZES`` over static input buffers; a step copies its
inputs into the buffers of the next captured size up, pads the rest (slot -1: no KV write; a one-token
context in block 0 whose output is discarded) and replays. Triton kernels only (no host syncs).
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


class DecodeGraphs:
    """Captured decode forwards keyed by padded batch size."""

    def __init__(self, model: CausalLM, kv_caches: list[KVCache], block_size: int,
                 max_model_len: int) -> None:
        device = next(model.parameters()).device
        self.model = model
        self.max_blocks = -(-max_model_len // block_size)
        n = _CAPTURE_SIZES[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        with torch.inference_mode():
            for size in reversed(_CAPTURE_SIZES):
                graph, out = self._capture(size, kv_caches, pool)
                pool = graph.pool()
                self.graphs[size] = (graph, out)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size],
                                 self.seq_lens[:size], self.query_start_loc[:size + 1],
                                 max_query_len=1, max_seq_len=1)

    def _capture(self, size: int, kv_caches: list[KVCache],
                 pool: object) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        args = (self.input_ids[:size], self.positions[:size], kv_caches, self._meta(size))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model(*args)  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.model(*args)
        return graph, out

    def can_run(self, inputs: ModelInput) -> bool:
        meta = inputs.meta
        num_tokens = inputs.input_ids.shape[0]
        return (num_tokens == meta.seq_lens.shape[0] and num_tokens <= _CAPTURE_SIZES[-1]
                and meta.block_tables.shape[1] <= self.max_blocks)

    def run(self, inputs: ModelInput) -> torch.Tensor:
        num_tokens = inputs.input_ids.shape[0]
        size = next(s for s in _CAPTURE_SIZES if s >= num_tokens)
        meta = inputs.meta
        self.input_ids[:num_tokens].copy_(inputs.input_ids)
        self.positions[:num_tokens].copy_(inputs.positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        self.slot_mapping[num_tokens:size].fill_(-1)
        self.block_tables[:num_tokens, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.seq_lens[:num_tokens].copy_(meta.seq_lens)
        self.seq_lens[num_tokens:size].fill_(1)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:num_tokens]
