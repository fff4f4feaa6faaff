"""twinserve's twin beside Vidur on the same trace: request latencies and step times.

    python -m twinserve.benchmarks.vidur_compare --twin RUN_DIR --vidur VIDUR_RUN_DIR \\
        [--twin-cpu-s S] [--vidur-cpu-s S] [--twin-wall-s S] [--vidur-wall-s S]

``RUN_DIR`` is a ``twinserve simulate`` run folder; ``VIDUR_RUN_DIR`` the timestamped output
folder of ``python -m vidur.main`` (microsoft/vidur, run in its own environment, never a
dependency) with ``--metrics_config_keep_individual_batch_metrics`` (its ``batch_metrics.csv``).
Vidur's request metrics map to vLLM's as TTFT = ``prefill_e2e_time``, TPOT =
``decode_time_execution_plus_preemption_normalized``, E2EL = ``request_e2e_time``. Step kinds:
prefill (no decodes), decode (no prefill tokens), mixed; decode steps also by batch size.
``benchmarks/vidur_compare.md`` has the set-up used (same trace, limits and KV blocks).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BUCKETS = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 1024))


@dataclass(slots=True, frozen=True)
class Step:
    seconds: float
    prefill_tokens: int
    decode_tokens: int

    @property
    def kind(self) -> str:
        if self.prefill_tokens and self.decode_tokens:
            return "mixed"
        return "prefill" if self.prefill_tokens else "decode"


def twin_requests(run: Path) -> dict[str, list[float]]:
    rows = list(csv.DictReader((run / "requests.csv").open()))
    ok = [r for r in rows if r["success"] == "1"]
    return {m: [float(r[f"{m}_ms"]) for r in ok if r[f"{m}_ms"]] for m in ("ttft", "tpot", "e2el")}


def vidur_requests(run: Path) -> dict[str, list[float]]:
    rows = list(csv.DictReader((run / "request_metrics.csv").open()))
    columns = {"ttft": "prefill_e2e_time", "tpot": "decode_time_execution_plus_preemption_normalized",
               "e2el": "request_e2e_time"}
    return {m: [1e3 * float(r[c]) for r in rows if r[c]] for m, c in columns.items()}


def twin_steps(run: Path) -> list[Step]:
    return [Step(float(r["duration"]), int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]))
            for r in csv.DictReader((run / "steps.csv").open())]


def vidur_steps(run: Path) -> list[Step]:
    return [Step(float(r["batch_execution_time"]), int(float(r["batch_num_prefill_tokens"])),
                 int(float(r["batch_num_decode_tokens"])))
            for r in csv.DictReader((run / "batch_metrics.csv").open())]


def p90(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def _diff(a: float, b: float) -> str:
    return f"{100 * (a - b) / b:+7.1f}" if b else "    n/a"


def request_table(twin: dict[str, list[float]], vidur: dict[str, list[float]]) -> list[str]:
    lines = [f"  {'metric':<12} {'twinserve':>11} {'Vidur':>11} {'diff %':>7}"]
    for m in ("ttft", "tpot", "e2el"):
        for stat, fn in (("mean", statistics.fmean), ("p90", p90)):
            a, b = fn(twin[m]), fn(vidur[m])
            lines.append(f"  {stat + ' ' + m:<12} {a:>11.1f} {b:>11.1f} {_diff(a, b)}")
    return lines


def _groups(steps: Sequence[Step]) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = {}
    for s in steps:
        groups.setdefault(s.kind, []).append(s.seconds)
        if s.kind == "decode":
            lo, hi = next(b for b in BUCKETS if b[0] <= s.decode_tokens <= b[1])
            groups.setdefault(f"decode {lo}-{hi}", []).append(s.seconds)
    return groups


def step_table(twin: Sequence[Step], vidur: Sequence[Step]) -> list[str]:
    a, b = _groups(twin), _groups(vidur)
    lines = [f"  {'steps':<16} {'n twin':>7} {'n Vidur':>8} {'mean twin':>10} {'mean Vidur':>11} "
             f"{'diff %':>7} {'p50 twin':>9} {'p50 Vidur':>10}"]
    keys = ["prefill", "mixed", "decode", *(f"decode {lo}-{hi}" for lo, hi in BUCKETS)]
    for k in keys:
        if k in a and k in b:
            ma, mb = statistics.fmean(a[k]) * 1e3, statistics.fmean(b[k]) * 1e3
            lines.append(f"  {k:<16} {len(a[k]):>7} {len(b[k]):>8} {ma:>10.2f} {mb:>11.2f} "
                         f"{_diff(ma, mb)} {statistics.median(a[k]) * 1e3:>9.2f} "
                         f"{statistics.median(b[k]) * 1e3:>10.2f}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinserve.benchmarks.vidur_compare",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--twin", required=True, type=Path, help="twinserve simulate run folder")
    p.add_argument("--vidur", required=True, type=Path, help="Vidur's output folder")
    for who in ("twin", "vidur"):
        p.add_argument(f"--{who}-cpu-s", type=float, help=f"{who}'s CPU seconds, start-up included")
        p.add_argument(f"--{who}-wall-s", type=float, help=f"{who}'s wall seconds")
    args = p.parse_args(argv)
    print("requests (ms):")
    print("\n".join(request_table(twin_requests(args.twin), vidur_requests(args.vidur))))
    print("step times (ms):")
    print("\n".join(step_table(twin_steps(args.twin), vidur_steps(args.vidur))))
    for what in ("cpu", "wall"):
        t, v = getattr(args, f"twin_{what}_s"), getattr(args, f"vidur_{what}_s")
        if t and v:
            print(f"{what} seconds: twinserve {t:.1f}, Vidur {v:.1f} (twinserve {v / t:.1f}x faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
