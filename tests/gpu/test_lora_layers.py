"""``LinearLoRA``'s batched product against the plain per-row reference ``W x + B_a (A_a x)``:
the torch path (CPU) and the Triton path (run here in Triton's interpreter, in a subprocess
started with TRITON_INTERPRET=1, which must be set before triton is imported) on a fused
three-projection layer, with adapters of different ranks and targets, rows of one adapter both
contiguous and scattered, and base-model rows between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

SHARDS = [("q_proj", 0, 24), ("k_proj", 24, 8), ("v_proj", 32, 8)]
IN = 20
# slot -> (rank, projections it targets)
ADAPTERS = {0: (4, ("q_proj", "v_proj")), 1: (8, ("q_proj", "k_proj", "v_proj")), 2: (2, ())}
# (slot or None, rows): adapter 1's rows are split by a base-model row, adapter 2 targets nothing
ROWS = [(0, 3), (None, 2), (1, 4), (None, 1), (1, 2), (2, 2)]


def _case(dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    pairs = {slot: {name: (torch.randn(rank, IN, generator=g),
                           torch.randn(size, rank, generator=g))
                    for name, _, size in SHARDS if name in targets}
             for slot, (rank, targets) in ADAPTERS.items()}
    total = sum(n for _, n in ROWS)
    x = torch.randn(total, IN, generator=g).to(dtype)
    base = torch.randn(total, 40, generator=g).to(dtype)
    return pairs, x, base


def _run(use_triton: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's result, the per-row reference) for one path."""
    from twinserve.gpu.lora.lora_layers import LinearLoRA, LoRABatch
    pairs, x, base = _case(dtype)
    layer = LinearLoRA(SHARDS, IN, max_loras=3, max_rank=8, dtype=dtype,
                       device=torch.device("cpu"), use_triton=use_triton)
    for slot, (rank, _) in ADAPTERS.items():
        layer.set_slot(slot, pairs[slot], rank)
    ranges, row = [], 0
    for slot, n in ROWS:
        if slot is not None:
            ranges.append((slot, row, row + n))
        row += n
    out = base.clone()
    layer.add_deltas(x, out, LoRABatch.build(ranges, torch.device("cpu")))
    want = base.float().clone()
    row = 0
    for slot, n in ROWS:
        for t in range(row, row + n):
            for name, off, size in SHARDS:
                if slot is not None and name in pairs[slot]:
                    a, b = pairs[slot][name]
                    want[t, off:off + size] += b @ (a @ x[t].float())
        row += n
    return out.float(), want


def _errors() -> dict[str, float]:
    results = {}
    for use_triton in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            got, want = _run(use_triton, dtype)
            key = f"{'triton' if use_triton else 'torch'}-{str(dtype).split('.')[1]}"
            results[key] = float(((got - want).abs() / (1 + want.abs())).max())
    return results


def test_both_paths_equal_the_per_row_reference() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert errors["torch-float32"] < 1e-5 and errors["triton-float32"] < 1e-5, errors
    assert errors["torch-bfloat16"] < 5e-2 and errors["triton-bfloat16"] < 5e-2, errors


def test_feature_major_outputs_get_the_same_deltas() -> None:
    """The CPU MLP path's outputs are ``[out, T]``: contiguous and scattered segments."""
    from twinserve.gpu.lora.lora_layers import LinearLoRA, LoRABatch
    pairs, x, base = _case(torch.float32)
    layer = LinearLoRA(SHARDS, IN, 3, 8, torch.float32, torch.device("cpu"), False)
    layer.set_slot(1, pairs[1], 8)
    for ranges in ([(1, 0, 3)], [(1, 0, 3), (1, 5, 7)]):
        batch = LoRABatch.build(ranges, torch.device("cpu"))
        row_major, feature_major = base.clone(), base.t().contiguous()
        layer.add_deltas(x, row_major, batch)
        layer.add_deltas(x, feature_major, batch, feature_major=True)
        torch.testing.assert_close(row_major, feature_major.t(), rtol=1e-5, atol=1e-5)
        assert not torch.equal(row_major[:3], base[:3])
        assert torch.equal(row_major[3:5], base[3:5])  # rows 3, 4 have no adapter


def test_stacked_products_equal_the_loop_over_segments() -> None:
    """3+ adapters of similar lengths go through torch.bmm (StackedRows): uniform consecutive
    slices, scattered rows with padding, slots not consecutive; the loop is the reference."""
    from twinserve.gpu.lora.lora_layers import LinearLoRA, LoRABatch
    pairs, x, base = _case(torch.float32)
    layer = LinearLoRA(SHARDS, IN, 4, 8, torch.float32, torch.device("cpu"), False)
    for slot, (rank, _) in ADAPTERS.items():
        layer.set_slot(slot + 1 if slot else 0, pairs[slot], rank)  # slots 0, 2, 3
    cases = {"uniform": [(0, 0, 4), (2, 4, 8), (3, 8, 12)],
             "scattered": [(0, 0, 3), (2, 3, 6), (0, 7, 9), (3, 9, 13)],
             "consecutive-slots": [(1, 0, 3), (2, 3, 6), (3, 7, 10)]}  # slot 1 holds nothing
    for name, ranges in cases.items():
        batch = LoRABatch.build(ranges, torch.device("cpu"))
        assert batch.stacked is not None, name
        assert batch.stacked.uniform == (name == "uniform"), name
        assert (batch.stacked.first_slot is not None) == (name == "consecutive-slots"), name
        for feature_major in (False, True):
            got = base.t().contiguous() if feature_major else base.clone()
            want = got.clone()
            layer.add_deltas(x, got, batch, feature_major)
            batch.stacked, stacked = None, batch.stacked
            layer.add_deltas(x, want, batch, feature_major)
            batch.stacked = stacked
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert not torch.equal(got, base.t() if feature_major else base), name


if __name__ == "__main__":
    print(json.dumps(_errors()))
