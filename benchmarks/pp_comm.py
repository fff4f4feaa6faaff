"""Pipeline parallelism on this machine: PP=1 against PP=2 (one thread per stage), with and without
the batch queue, side by side.

    python -m twinserve.benchmarks.pp_comm [--rounds 2] [--dtype float32] [--model DIR] \
        [--workloads 16x64,1x64,128x32] [--pp-layer-partition 19,11]

Both engines use every core: PP=1 one process with all the threads, PP=2 two processes with half
each, the bundled model's 30 layers split 15 + 15 (pipeline parallelism needs no head split, so
the bundled SmolLM2-135M runs as it is). PP=2 runs three ways: with vLLM's batch queue (up to 2
batches in flight, the engine's default; ``2+queue``), with the queue balancing the running
requests over both batches (``BatchQueue.balance``; ``2+bal``), and with
``LLMEngine.batch_queue = None`` (one batch at a time, the stages taking turns; vLLM has no
switch for this; ``2``). Timed on the driver (stage 0): its send of the hidden states and
residual to stage 1 (and the bytes; a send also waits until stage 1 takes it), and its wait for
the logits (stage 1's compute plus both transfers, less what the driver overlapped): the
driver's idle share, its side of the bubble. Workloads: 16 prompts x 64 generated tokens, 1 x 64
and 128 x 32 (32-token prompts, greedy, ignore_eos), in interleaved rounds; medians are printed.
Only 128 x 32 fills two batches: the engines take up to 128 sequences, which the queue keeps in
one batch unless it balances them (two of 64). ``--pp-layer-partition A,B`` adds a third engine,
PP=2 on that split (``2p+bal``, balanced), in the same rounds.
``batch ms``: wall time per batch completed; ``in flight``: the most batches in the pipeline.
Last, the PP=2 engine's shared-stage slowdown (``gpu.measurement.stage_overlap``: its first
stage alone and beside the second, with the send per step alone), the figure ``calibrate``
stores as the twin's ``shared_stage_slowdown``; ``--no-overlap`` skips it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

PROMPT_LEN = 32
WORKLOADS = {"16x64": (16, 64), "1x64": (1, 64), "128x32": (128, 32)}


def _engine(model: str, pp: int, dtype: str, partition: str | None = None):
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.engine.llm_engine import LLMEngine
    return LLMEngine(EngineArgs(model=model, dtype=dtype, pipeline_parallel_size=pp,
                                max_model_len=512, max_num_seqs=128,
                                pp_layer_partition=partition if pp > 1 else None))


# label, pp, batch queue (None: off; else its balance)
MODES: tuple[tuple[str, int, bool | None], ...] = (
    ("1", 1, None), ("2", 2, None), ("2+queue", 2, False), ("2+bal", 2, True))


def _run(engine, mode: tuple[str, int, bool | None], num: int, out_len: int, vocab: int,
         threads: int) -> dict[str, float]:
    from twinserve.core.sampling_params import SamplingParams
    _, pp, queued = mode
    torch.set_num_threads(threads if pp == 1 else max(1, threads // pp))
    rng = random.Random(num)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    tp = engine.runner.tp
    links = None if tp is None else tp.group.pipeline
    if links is not None:
        links.timed = True
        links.send_s = links.recv_s = 0.0
        links.bytes_sent = 0
        tp.max_batches_in_flight = 0
    for _ in range(num):
        engine.add_request([rng.randrange(100, vocab) for _ in range(PROMPT_LEN)], params)
    t0 = time.perf_counter()
    first = engine.num_steps
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - t0
    row = {"tok_s": num * out_len / wall, "wall_s": wall, "steps": engine.num_steps - first,
           "send_s": 0.0, "wait_s": 0.0, "bytes": 0.0, "in_flight": 1.0}
    if links is not None:
        row.update(send_s=links.send_s, wait_s=links.recv_s, bytes=float(links.bytes_sent),
                   in_flight=float(tp.max_batches_in_flight or 1))
    return row


def main(argv: list[str] | None = None) -> int:
    from twinserve.gpu.models.default_model import default_model_path
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory (default: the bundled model)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="cores to use in all (default 2)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--pp-layer-partition", default=None, metavar="A,B",
                    help="also a PP=2 engine on these layers per stage, balanced (2p+bal)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="skip the shared-stage slowdown reading")
    args = ap.parse_args(argv)
    model = args.model or str(default_model_path())
    # engines by name: "1", "2", and "2p", PP=2 on the partition given (balanced queue only)
    engines = {"1": _engine(model, 1, args.dtype), "2": _engine(model, 2, args.dtype)}
    modes = MODES
    if args.pp_layer_partition is not None:
        engines["2p"] = _engine(model, 2, args.dtype, args.pp_layer_partition)
        modes = (*MODES, ("2p+bal", 2, True))
    queues = {key: engine.batch_queue for key, engine in engines.items()}
    vocab = engines["1"].runner.vocab_size
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for r in range(args.rounds):
            for name in args.workloads.split(","):
                num, out_len = WORKLOADS[name]
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    key = "2p" if mode[0].startswith("2p") else str(mode[1])
                    engine, queue = engines[key], queues[key]
                    if mode[1] > 1:
                        engine.batch_queue = None if mode[2] is None else queue
                        if queue is not None and mode[2] is not None:
                            queue.balance = mode[2]
                    row = _run(engine, mode, num, out_len, vocab, args.threads)
                    rows.setdefault((name, mode[0]), []).append(row)
                    print(f"round {r + 1} {name} pp={mode[0]}: {row['tok_s']:.1f} tok/s, send "
                          f"{row['send_s']:.2f} s, logits wait {row['wait_s']:.2f} s of "
                          f"{row['wall_s']:.1f} s", file=sys.stderr, flush=True)
        overlap = None if args.no_overlap else _overlap(engines["2"], max(1, args.threads // 2))
    finally:
        for engine in engines.values():
            engine.shutdown()
    split = f"; 2p: PP=2 on layers {args.pp_layer_partition}" if args.pp_layer_partition else ""
    print(f"model {model} ({args.dtype}), {args.rounds} rounds, medians{split}")
    print(f"{'workload':<8} {'pp':>8} {'in flight':>9} {'tok/s':>8} {'vs pp1':>7} {'batch ms':>9} "
          f"{'send ms/batch':>14} {'share':>6} {'KB/batch':>9} {'logits wait ms/batch':>21} "
          f"{'driver idle':>12}")
    for name in args.workloads.split(","):
        base = statistics.median(r["tok_s"] for r in rows[(name, "1")])
        for label, _, _ in modes:
            rs = rows[(name, label)]
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            per = 1e3 / med["steps"]
            print(f"{name:<8} {label:>8} {med['in_flight']:>9.0f} {med['tok_s']:>8.1f} "
                  f"{med['tok_s'] / base:>7.2f} {med['wall_s'] * per:>9.1f} "
                  f"{med['send_s'] * per:>14.2f} {med['send_s'] / med['wall_s']:>6.1%} "
                  f"{med['bytes'] / med['steps'] / 1024:>9.1f} {med['wait_s'] * per:>21.1f} "
                  f"{med['wait_s'] / med['wall_s']:>12.1%}")
    if overlap is not None:
        print(overlap)
    return 0


def _overlap(engine, threads: int) -> str:
    from twinserve.gpu.measurement.stage_overlap import measure_stage_overlap
    torch.set_num_threads(threads)  # (the driver's stage as PP=2 runs it)
    return measure_stage_overlap(engine.runner).describe()


if __name__ == "__main__":
    sys.exit(main())
