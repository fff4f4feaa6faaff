"""gpu/worker/cuda_graphs.py, the parts that run without a GPU: the memory-profile step's batch,
and which captured graph (batch size, queries per sequence) runs a step, if any."""

from __future__ import annotations

import pytest
import torch

from twinserve.gpu.models.model_loader import load_model
from twinserve.gpu.worker.cuda_graphs import capture_keys, dummy_prefill, graph_key


def test_the_memory_profile_step_splits_a_budget_past_the_model_length(tiny_model_dirs):
    # a step budget of 300 tokens on a 128-token model (an H200's offline default is 16k tokens
    # against Llama-3-8B's 8k): prompts of 128, 128 and 44 tokens, no position past the RoPE table,
    # each prompt attending only to itself
    cpu = torch.device("cpu")
    model = load_model(tiny_model_dirs["llama-tied"], torch.float32, cpu, 128)
    positions, meta, num_blocks = dummy_prefill(300, 128, 16, cpu)
    assert meta.seq_lens.tolist() == [128, 128, 44] and meta.query_start_loc.tolist() == [0, 128, 256, 300]
    assert int(positions.max()) == 127 and positions.shape == (300,)
    assert meta.slot_mapping.unique().numel() == 300 and int(meta.slot_mapping.max()) < num_blocks * 16

    def forward(ids, pos, meta, blocks):
        shape = (blocks, 16, model.layers[0].num_kv_heads, model.config.head_dim)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers]
        model.backend.prepare(meta, 16)  # the CPU path's gathers, as the runner makes them
        with torch.inference_mode():
            return model(ids, pos, caches, meta)

    ids = torch.randint(3, 300, (300,), generator=torch.Generator().manual_seed(0))
    together = forward(ids, positions, meta, num_blocks)
    for start, n in ((0, 128), (128, 128), (256, 44)):
        pos, alone, blocks = dummy_prefill(n, 128, 16, cpu)
        torch.testing.assert_close(together[start:start + n], forward(ids[start:start + n], pos, alone, blocks))


def test_decode_and_uniform_verification_steps_find_their_graph():
    ks = (4,)
    assert graph_key(3, 3, 1, ks) == (4, 1)  # decodes: the next size up
    assert graph_key(256, 256, 1, ks) == (256, 1) and graph_key(257, 257, 1, ks) is None
    assert graph_key(15, 3, 5, ks) == (4, 5)  # three sequences verifying 4 drafts each
    assert graph_key(240, 48, 5, ks) == (48, 5)
    assert graph_key(250, 50, 5, ks) is None  # padded to 64 x 5 tokens: past the largest capture
    # eager: k not captured, mixed query lengths (12 tokens, longest 5), a prefill chunk
    assert graph_key(12, 3, 4, ks) is None and graph_key(12, 3, 5, ks) is None
    assert graph_key(15, 3, 5, ()) is None and graph_key(64, 1, 64, ks) is None
    assert graph_key(0, 0, 0, ks) is None


def test_capture_keys_cover_what_graph_key_asks_for():
    keys = capture_keys((4, 2))
    assert (256, 1) in keys and (48, 5) in keys and (64, 5) not in keys and (64, 3) in keys
    for num_seqs in range(1, 80):
        for queries in (1, 3, 5):
            key = graph_key(num_seqs * queries, num_seqs, queries, (4, 2))
            assert key is None or key in keys
    with pytest.raises(ValueError, match="verify_ks"):
        capture_keys((0,))
