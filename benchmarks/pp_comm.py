"""Pipeline parallelism on this machine: PP=1 against PP=2 (one thread per stage), side by side.

    python -m twinserve.benchmarks.pp_comm [--rounds 2] [--dtype float32] [--model DIR]

Both engines use every core: PP=1 one process with all the threads, PP=2 two processes with half
each, the bundled model's 30 layers split 15 + 15 (pipeline parallelism needs no head split, so
the bundled SmolLM2-135M runs as it is). One batch is in flight, so the stages take turns: what
the run shows is what the pipeline costs here, timed on the driver (stage 0): its send of the
hidden states and residual to stage 1 (and the bytes), and its wait for the logits, which is
stage 1's compute plus both transfers (the driver idles meanwhile: the bubble). Workloads: 16
prompts x 64 generated tokens and 1 x 64 (32-token prompts, greedy, ignore_eos), in interleaved
rounds; medians are printed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

PROMPT_LEN = 32
WORKLOADS = {"16x64": (16, 64), "1x64": (1, 64)}


def _engine(model: str, pp: int, dtype: str):
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.engine.llm_engine import LLMEngine
    return LLMEngine(EngineArgs(model=model, dtype=dtype, pipeline_parallel_size=pp,
                                max_model_len=512, max_num_seqs=64))


def _run(engine, pp: int, num: int, out_len: int, vocab: int, threads: int) -> dict[str, float]:
    from twinserve.core.sampling_params import SamplingParams
    torch.set_num_threads(threads if pp == 1 else max(1, threads // pp))
    rng = random.Random(num)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    links = None if engine.runner.tp is None else engine.runner.tp.group.pipeline
    if links is not None:
        links.timed = True
        links.send_s = links.recv_s = 0.0
        links.bytes_sent = 0
    for _ in range(num):
        engine.add_request([rng.randrange(100, vocab) for _ in range(PROMPT_LEN)], params)
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    row = {"tok_s": num * out_len / wall, "wall_s": wall, "steps": steps,
           "send_s": 0.0, "wait_s": 0.0, "bytes": 0.0}
    if links is not None:
        row.update(send_s=links.send_s, wait_s=links.recv_s, bytes=float(links.bytes_sent))
    return row


def main(argv: list[str] | None = None) -> int:
    from twinserve.gpu.models.default_model import default_model_path
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory (default: the bundled model)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="cores to use in all (default 2)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    args = ap.parse_args(argv)
    model = args.model or str(default_model_path())
    engines = {pp: _engine(model, pp, args.dtype) for pp in (1, 2)}
    vocab = engines[1].runner.vocab_size
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        for r in range(args.rounds):
            for name in args.workloads.split(","):
                num, out_len = WORKLOADS[name]
                for pp in ((1, 2) if r % 2 == 0 else (2, 1)):
                    row = _run(engines[pp], pp, num, out_len, vocab, args.threads)
                    rows.setdefault((name, pp), []).append(row)
                    print(f"round {r + 1} {name} pp={pp}: {row['tok_s']:.1f} tok/s, send "
                          f"{row['send_s']:.2f} s, logits wait {row['wait_s']:.2f} s of "
                          f"{row['wall_s']:.1f} s", file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    print(f"model {model} ({args.dtype}), {args.rounds} rounds, medians")
    print(f"{'workload':<8} {'pp':>2} {'tok/s':>8} {'vs pp1':>7} {'step ms':>8} "
          f"{'send ms/step':>13} {'share':>6} {'KB/step':>8} {'logits wait ms/step':>20}")
    for name in args.workloads.split(","):
        base = statistics.median(r["tok_s"] for r in rows[(name, 1)])
        for pp in (1, 2):
            rs = rows[(name, pp)]
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            per_step = 1e3 / med["steps"]
            print(f"{name:<8} {pp:>2} {med['tok_s']:>8.1f} {med['tok_s'] / base:>7.2f} "
                  f"{med['wall_s'] * per_step:>8.1f} {med['send_s'] * per_step:>13.2f} "
                  f"{med['send_s'] / med['wall_s']:>6.1%} "
                  f"{med['bytes'] / med['steps'] / 1024:>8.1f} {med['wait_s'] * per_step:>20.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
