"""gpu/worker/cuda_graphs.py, the parts that run without a GPU: the memory-profile step's batch."""

from __future__ import annotations

import torch

from twinserve.gpu.models.model_loader import load_model
from twinserve.gpu.worker.cuda_graphs import dummy_prefill


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
