"""Mixture-of-experts step time on this machine, side by side in interleaved rounds (medians):

1. a tiny Qwen3-MoE-shaped model (8 experts, top-2) against the dense Qwen3 model of the same
   active size (intermediate = 2 x the experts'), a decode step at batch 1 and at batch 64;
2. the MoE layer's expert-grouped path against its per-token loop (``gpu/layers/moe.py``), at 1 and 64
   tokens.

    python -m twinserve.benchmarks.moe_step [--rounds 7] [--threads 2] [--json out.json]

Weights are random (N(0, 0.02), built in memory: nothing is read or downloaded); fp32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from twinserve.core.model_config import ModelConfig
from twinserve.gpu.layers.attention_backend import AttentionMetadata
from twinserve.gpu.models.model import CausalLM

SHAPE = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6)
EXPERTS, TOP_K, EXPERT_INTER = 8, 2, 512
CONTEXT, BLOCK = 128, 16


def build(moe: bool) -> CausalLM:
    raw = {**SHAPE, "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
           "intermediate_size": TOP_K * EXPERT_INTER}
    if moe:
        raw.update(num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                   moe_intermediate_size=EXPERT_INTER, norm_topk_prob=True)
    config = ModelConfig.from_hf_dict(raw, "moe" if moe else "dense").with_dtype("float32")
    model = CausalLM(config, 512, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else
                    torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def decode_step(model: CausalLM, batch: int) -> Callable[[], None]:
    """One decode step of ``batch`` sequences at context ``CONTEXT`` over a paged cache."""
    config = model.config
    per_seq = CONTEXT // BLOCK + 1
    shape = (batch * per_seq, BLOCK, config.num_key_value_heads, config.head_dim)
    caches = [(torch.randn(shape) * 0.1, torch.randn(shape) * 0.1)
              for _ in range(config.num_hidden_layers)]
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), CONTEXT, dtype=torch.int32)
    slots = (tables[:, (CONTEXT - 1) // BLOCK].long() * BLOCK + (CONTEXT - 1) % BLOCK)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=lens,
                             query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
                             max_query_len=1, max_seq_len=CONTEXT)
    ids = torch.randint(0, config.vocab_size, (batch,))
    positions = torch.full((batch,), CONTEXT - 1)

    def run() -> None:
        with torch.inference_mode():
            model.backend.prepare(meta, BLOCK)
            model.compute_logits(model(ids, positions, caches, meta))
    return run


def interleaved(cases: dict[str, Callable[[], None]], rounds: int,
                min_round_s: float = 0.1) -> dict[str, float]:
    """Median seconds per call of each case; each round runs every case in turn, a short case
    repeated to fill ``min_round_s`` (a shared machine's scheduler slices are ~20 ms)."""
    repeats = {}
    for name, fn in cases.items():
        fn()  # warm-up
        start = time.perf_counter()
        fn()
        repeats[name] = max(1, int(min_round_s / max(time.perf_counter() - start, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(repeats[name]):
                fn()
            times[name].append((time.perf_counter() - start) / repeats[name])
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    moe, dense = build(True), build(False)
    layer = moe.layers[0].moe
    assert layer is not None
    cases: dict[str, Callable[[], None]] = {}
    for batch in (1, 64):
        cases[f"moe_step_b{batch}"] = decode_step(moe, batch)
        cases[f"dense_step_b{batch}"] = decode_step(dense, batch)
    for tokens in (1, 64):
        x = torch.randn(tokens, SHAPE["hidden_size"])
        cases[f"grouped_t{tokens}"] = lambda x=x: layer.forward(x)
        cases[f"per_token_t{tokens}"] = lambda x=x: layer.forward_reference(x)
    with torch.inference_mode():
        medians = interleaved(cases, args.rounds)
    for name, seconds in medians.items():
        print(f"{name:18s} {seconds * 1e3:9.2f} ms")
    for batch in (1, 64):
        ratio = medians[f"moe_step_b{batch}"] / medians[f"dense_step_b{batch}"]
        print(f"moe / dense step, batch {batch}: {ratio:.2f}x")
    for tokens in (1, 64):
        ratio = medians[f"per_token_t{tokens}"] / medians[f"grouped_t{tokens}"]
        print(f"per-token loop / grouped, {tokens} tokens: {ratio:.1f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({k: v * 1e3 for k, v in medians.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
