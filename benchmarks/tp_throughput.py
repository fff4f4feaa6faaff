"""Tensor parallelism on this machine: TP=1 against TP=2 (one thread per rank), side by side.

    python -m twinserve.benchmarks.tp_throughput [--rounds 3] [--dtype float32] [--model DIR]

Both engines use every core: TP=1 one process with all the threads, TP=2 two processes with half
each. On two cores sharding cannot speed anything up; what the run shows is what tensor parallelism
costs here: the all-reduces (two per layer, plus the embedding's) and the logits' all-gather, timed
on rank 0 (so they include waiting for the slower rank), beside the step time. Workloads: 64
prompts x 128 generated tokens and 1 x 128 (32-token prompts, greedy, ignore_eos), in interleaved
rounds; medians are printed.

The default model is random-weight and shaped as SmolLM2-135M but with 8 query heads and 2 KV
heads (hidden 512): the bundled model's 9 heads do not split over 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

DEFAULT_DIR = Path("/tmp/twinserve-tp-bench/smollm2-shaped-8h")
PROMPT_LEN = 32
WORKLOADS = {"64x128": (64, 128), "1x128": (1, 128)}


def shaped_model(out: Path, dtype: str) -> Path:
    """A SmolLM2-135M-shaped Llama (30 layers, vocab 49152) with 8 heads / 2 KV heads."""
    from twinserve.benchmarks.random_model import write_random_model
    from twinserve.gpu.models.default_model import default_model_path
    cfg = json.loads((default_model_path() / "config.json").read_text())
    cfg.update(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    out.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{out.name}-config.json"
    path.write_text(json.dumps(cfg))
    return write_random_model(out, str(path), dtype)


def _engine(model: str, tp: int, dtype: str):
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.engine.llm_engine import LLMEngine
    return LLMEngine(EngineArgs(model=model, dtype=dtype, tensor_parallel_size=tp,
                                max_model_len=512, max_num_seqs=64))


def _run(engine, tp: int, num: int, out_len: int, vocab: int, threads: int) -> dict[str, float]:
    from twinserve.core.sampling_params import SamplingParams
    torch.set_num_threads(threads if tp == 1 else max(1, threads // tp))
    rng = random.Random(num)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    group = None if engine.runner.tp is None else engine.runner.tp.group
    if group is not None:
        group.timed = True
        group.stats.reset()
    for _ in range(num):
        engine.add_request([rng.randrange(100, vocab) for _ in range(PROMPT_LEN)], params)
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    row = {"tok_s": num * out_len / wall, "wall_s": wall, "steps": steps,
           "all_reduce_s": 0.0, "all_gather_s": 0.0, "all_reduces": 0}
    if group is not None:
        s = group.stats
        row.update(all_reduce_s=s.all_reduce_s, all_gather_s=s.all_gather_s,
                   all_reduces=s.all_reduce_calls)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory (default: the shaped random model)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="cores to use in all (default 2)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    args = ap.parse_args(argv)
    model = args.model or str(shaped_model(DEFAULT_DIR, args.dtype))
    engines = {tp: _engine(model, tp, args.dtype) for tp in (1, 2)}
    vocab = engines[1].runner.vocab_size
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        for r in range(args.rounds):
            for name in args.workloads.split(","):
                num, out_len = WORKLOADS[name]
                for tp in ((1, 2) if r % 2 == 0 else (2, 1)):
                    row = _run(engines[tp], tp, num, out_len, vocab, args.threads)
                    rows.setdefault((name, tp), []).append(row)
                    print(f"round {r + 1} {name} tp={tp}: {row['tok_s']:.1f} tok/s, "
                          f"all-reduce {row['all_reduce_s']:.2f} s of {row['wall_s']:.1f} s",
                          file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    print(f"model {model} ({args.dtype}), {args.rounds} rounds, medians")
    print(f"{'workload':<8} {'tp':>2} {'tok/s':>8} {'vs tp1':>7} {'step ms':>8} "
          f"{'allreduce ms/step':>18} {'share':>6} {'gather ms/step':>15} {'calls/step':>10}")
    for name in args.workloads.split(","):
        base = statistics.median(r["tok_s"] for r in rows[(name, 1)])
        for tp in (1, 2):
            rs = rows[(name, tp)]
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            per_step = 1e3 / med["steps"]
            print(f"{name:<8} {tp:>2} {med['tok_s']:>8.1f} {med['tok_s'] / base:>7.2f} "
                  f"{med['wall_s'] * per_step:>8.1f} {med['all_reduce_s'] * per_step:>18.2f} "
                  f"{med['all_reduce_s'] / med['wall_s']:>6.1%} "
                  f"{med['all_gather_s'] * per_step:>15.2f} {med['all_reduces'] / med['steps']:>10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
