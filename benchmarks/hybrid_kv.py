"""The hybrid KV cache (Gemma's mixed sliding/full layers) against one block table for every
layer (``disable_hybrid_kv_cache_manager``), in the twin, side by side.

    python -m twinserve.benchmarks.hybrid_kv                          # capacity + Mooncake slice
    python -m twinserve.benchmarks.hybrid_kv --num-requests 0         # capacity only (seconds)
    python -m twinserve.benchmarks.hybrid_kv --num-requests 2000 --rounds 3
    python -m twinserve.benchmarks.hybrid_kv --num-requests 0 --engine    # + the real engine

1. Capacity of Gemma 3 27B on each bundled GPU profile: KV blocks, bytes per block, and the
   longest sequence the cache holds (``core.engine_config.sequence_kv_tokens``), both layouts.
2. The first ``--num-requests`` of the Mooncake conversation trace (prompts up to tens of
   thousands of tokens) on one H200: completed share, throughput, median TTFT, peak KV usage,
   and the twin's wall and CPU seconds (the hybrid manager's extra bookkeeping: seven block
   tables per request instead of one), both layouts in interleaved rounds, medians.
3. ``--engine``: the real engine on this machine (CPU, fp32) with a small random-weight Gemma 3
   (Gemma 3 27B's layout, 12 layers of hidden 256, window 128): KV blocks in the same 64 MiB,
   the most blocks one request held, and seconds per generated token of a batch of long prompts,
   both layouts in interleaved rounds (the hybrid's per-group tables and attention plans).
"""

from __future__ import annotations

import argparse
import statistics
import time

from twinserve.core.engine_args import EngineArgs
from twinserve.core.engine_config import kv_cache_layout_of, sequence_kv_tokens
from twinserve.core.sampling_params import SamplingParams
from twinserve.simulator import SimConfig, simulate
from twinserve.simulator.run import build_engine_config
from twinserve.traces import first_n, load_trace

MODEL = "gemma-3-27b"
HARDWARE = ("a100-80gb", "h100-sxm", "h200")
LAYOUTS = {"hybrid": False, "one group": True}  # name -> disable_hybrid_kv_cache_manager


def capacity_rows(hardware: str) -> list[str]:
    rows = []
    for name, disabled in LAYOUTS.items():
        build = build_engine_config(SimConfig(
            model=MODEL, hardware=hardware, max_model_len=32768,
            disable_hybrid_kv_cache_manager=disabled))
        engine, spec = build.engine_config, build.model
        sched = engine.scheduler
        layout = kv_cache_layout_of(spec, hybrid=not disabled)
        longest = sequence_kv_tokens(layout, sched.num_gpu_blocks, sched.block_size,
                                     sched.max_num_batched_tokens)
        rows.append(f"{hardware:10s} {name:10s} {layout.num_groups:7d} "
                    f"{engine.block_bytes / 2**20:9.2f} {sched.num_gpu_blocks:9d} "
                    f"{longest:14,d}")
    return rows


def replay(num_requests: int, disabled: bool) -> tuple[dict[str, float], float, float]:
    trace = first_n(load_trace("mooncake"), num_requests)
    cfg = SimConfig(model=MODEL, hardware="h200", max_model_len=131072,
                    disable_hybrid_kv_cache_manager=disabled)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    result = simulate(cfg, trace)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    summary = result.summary
    figures = {"completed": summary["completed"] / len(trace),
               "output_throughput": float(summary["output_throughput"]),
               "median_ttft_ms": float(summary["median_ttft_ms"]),
               "peak_kv_usage": max(step.kv_usage for step in result.steps),
               "request_steps": float(sum(result.steps.column("num_seqs")))}
    return figures, wall, cpu


def small_gemma3(out: str) -> str:
    """A random-weight Gemma 3 text model with 27B's layer pattern, small enough for a CPU."""
    import json
    from pathlib import Path

    from twinserve.benchmarks.random_model import BUNDLED, write_random_model
    cfg = json.loads((BUNDLED / f"{MODEL}.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, vocab_size=4096,
               sliding_window=128, max_position_embeddings=8192)
    cfg.pop("_comment", None)
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / "source-config.json"
    path.write_text(json.dumps(cfg))
    return str(write_random_model(Path(out) / "model", str(path), "float32", num_layers=12))


def engine_run(model_dir: str, disabled: bool, prompt_len: int, batch: int,
               new_tokens: int) -> tuple[int, int, int, float]:
    """(KV blocks, most blocks one request held in all groups (its whole-prompt prefill), what
    it held in the last step (decoding), seconds per generated token)."""
    from twinserve.gpu.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", block_size=16,
                                  kv_cache_memory_bytes=64 << 20, max_model_len=4096,
                                  disable_hybrid_kv_cache_manager=disabled))
    kv = engine.scheduler.kv
    groups = getattr(kv, "groups", (kv,))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request([3 + (i * 7 + j) % 4000 for j in range(prompt_len)], params)
    held = last = decode_tokens = 0
    decode_s = 0.0
    while engine.has_unfinished_requests():
        decoding = all(r.num_output_tokens > 0 for r in engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        if decoding and engine.scheduler.running:
            decode_s += time.perf_counter() - start
            decode_tokens += len(engine.scheduler.running)
        now = [sum(len(g.tables[rid].blocks) - g.tables[rid].num_dropped for g in groups)
               for rid in groups[0].tables]
        if now:
            held, last = max(held, *now), max(now)
    return (engine.scheduler.config.num_gpu_blocks, held, last,
            decode_s / max(decode_tokens, 1))


def engine_part(rounds: int) -> None:
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = small_gemma3(tmp)
        rows: dict[str, list[tuple[int, int, int, float]]] = {n: [] for n in LAYOUTS}
        for _ in range(rounds):
            for name, disabled in LAYOUTS.items():
                rows[name].append(engine_run(model_dir, disabled, 1500, 8, 32))
    print(f"\nReal engine, CPU fp32, random Gemma 3 (12 layers, hidden 256, window 128), 64 MiB "
          f"of KV, 8 prompts of 1500 tokens + 32 generated (medians of {rounds} rounds)")
    print("(blocks held by one request: at its whole-prompt prefill, and decoding at the end; "
          "a hybrid block spans 2 layers, a one-group block 12)")
    print(f"{'layout':10s} {'blocks':>8s} {'peak held':>10s} {'last held':>10s} "
          f"{'decode ms/token':>16s}")
    per_token = {}
    for name, runs in rows.items():
        blocks, held, last, _ = runs[-1]
        per_token[name] = statistics.median(r[3] for r in runs)
        print(f"{name:10s} {blocks:8d} {held:10d} {last:10d} {per_token[name] * 1e3:16.3f}")
    print(f"decode time per token, hybrid / one group: "
          f"{per_token['hybrid'] / per_token['one group']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=400,
                        help="Mooncake requests to replay (0: capacity only)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", action="store_true",
                        help="also run the real engine on a small random Gemma 3 (minutes)")
    args = parser.parse_args()
    print(f"{MODEL}: KV capacity (max_model_len 32768, the profile's default batch limits)")
    print(f"{'hardware':10s} {'layout':10s} {'groups':>7s} {'MiB/block':>9s} {'blocks':>9s} "
          f"{'longest seq':>14s}")
    for hardware in HARDWARE:
        print("\n".join(capacity_rows(hardware)))
    if args.engine:
        engine_part(args.rounds)
    if args.num_requests <= 0:
        return
    runs: dict[str, list[tuple[dict[str, float], float, float]]] = {n: [] for n in LAYOUTS}
    for _ in range(args.rounds):  # interleaved: both layouts see the same machine load
        for name, disabled in LAYOUTS.items():
            runs[name].append(replay(args.num_requests, disabled))
    print(f"\nMooncake conversation trace, first {args.num_requests} requests, {MODEL} on one "
          f"H200 (medians of {args.rounds} rounds)")
    print(f"{'layout':10s} {'completed':>9s} {'out tok/s':>10s} {'p50 TTFT ms':>12s} "
          f"{'peak KV':>8s} {'wall s':>8s} {'cpu s':>8s} {'us/req-step':>12s}")
    per_step = {}
    for name, rounds in runs.items():
        figures = rounds[-1][0]  # the twin is deterministic: every round's figures agree
        cpu = statistics.median(c for _, _, c in rounds)
        per_step[name] = cpu / max(figures["request_steps"], 1.0) * 1e6
        print(f"{name:10s} {figures['completed']:9.1%} {figures['output_throughput']:10.1f} "
              f"{figures['median_ttft_ms']:12.1f} {figures['peak_kv_usage']:8.1%} "
              f"{statistics.median(w for _, w, _ in rounds):8.2f} {cpu:8.2f} "
              f"{per_step[name]:12.2f}")
    print("twin CPU per request-step, hybrid / one group: "
          f"{per_step['hybrid'] / per_step['one group']:.2f}x")


if __name__ == "__main__":
    main()
