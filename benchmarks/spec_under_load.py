"""Speculation under load on this CPU: an Azure conversation slice replayed for real as a burst
that saturates the engine (64+ requests running), with no speculation, ngram drafts at fixed
k = 4 (vLLM's behaviour) and ngram under the adaptive policy; modes interleaved round by round
(the order rotates), medians printed: output throughput and mean TPOT as ratios to no
speculation, the most requests running at once and the acceptance length.

    python -m twinserve.benchmarks.spec_under_load --rounds 3

The issue's bar: the adaptive policy never below 0.97x of no speculation.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from twinserve.benchmarks.spec_crossover import speculative_config
from twinserve.core.engine_args import EngineArgs
from twinserve.fidelity import replay
from twinserve.fidelity.backend import load_runner
from twinserve.fidelity.workload import TraceSpec

MODES = ("none", "fixed", "adaptive")


def _point(run: Path) -> dict[str, float]:
    s = json.loads((run / "summary.json").read_text())
    with (run / "steps.csv").open() as f:
        running = max(int(row["num_running"]) for row in csv.DictReader(f))
    return {"throughput": s["output_throughput"], "tpot": s["mean_tpot_ms"],
            "running": running, "length": s.get("spec_mean_acceptance_length") or 1.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--time-scale", type=float, default=50.0,
                   help="the slice's arrivals this many times faster (large: a burst)")
    p.add_argument("--max-output-tokens", type=int, default=32)
    args = p.parse_args(argv)
    workload = TraceSpec("azure-conv", num_requests=args.num_requests, time_scale=args.time_scale,
                         max_model_len=256, max_output_tokens=args.max_output_tokens).load()
    runners: dict[str, Any] = {}
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in MODES[r % 3:] + MODES[:r % 3]:
                engine = EngineArgs(max_model_len=256, max_num_seqs=128,
                                    max_num_batched_tokens=1024,
                                    speculative_config=speculative_config(mode, None))
                if mode not in runners:  # one load of the weights, a runner per proposer
                    runners[mode] = load_runner(engine, next(iter(runners.values()), None))
                run = replay(engine, workload, Path(tmp) / f"{mode}-{r}", runner=runners[mode])[0]
                rows[mode].append(_point(run))
                print(f"round {r + 1} {mode}: {rows[mode][-1]}", file=sys.stderr, flush=True)
    med = {m: {k: statistics.median(x[k] for x in rows[m]) for k in rows[m][0]} for m in MODES}
    base = med["none"]
    print(f"azure-conv, {args.num_requests} requests, time scale {args.time_scale:g}, "
          f"{args.rounds} rounds (medians)")
    print(f"{'mode':<9} {'out tok/s':>9} {'vs none':>7} {'TPOT ms':>8} {'vs none':>7} "
          f"{'max running':>11} {'accept len':>10}")
    for m in MODES:
        x = med[m]
        print(f"{m:<9} {x['throughput']:>9.1f} {x['throughput'] / base['throughput']:>7.3f} "
              f"{x['tpot']:>8.1f} {x['tpot'] / base['tpot']:>7.3f} {x['running']:>11.0f} "
              f"{x['length']:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
