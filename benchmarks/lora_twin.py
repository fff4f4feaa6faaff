"""Multi-LoRA in the twin: throughput and TTFT against ``max_loras``, and lora_affinity against fcfs.

32 adapters (rank 16 on all seven projections, drawn with equal weights per request) over the
Azure LLM 2023 conversation trace, Llama-3.1-8B on one H100 SXM, the twin's roofline profile.
Rows: the base model without adapters (the reference), fcfs with ``max_loras`` in {1, 4, 8, 16},
and lora_affinity (its default ``max_wait_s``) against fcfs at ``max_loras`` 4 and 8.

    python -m twinserve.benchmarks.lora_twin [--num-requests 3000] [--time-scale 2]

The default rate, the trace's first 3,000 requests replayed twice as fast (~9.5 req/s), is one the
base model serves with a p99 TTFT well under a second, 16 slots nearly, and fewer slots not: the
differences show. The simulator is deterministic, so one run per configuration is enough.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from twinserve.simulator import SimConfig, simulate
from twinserve.simulator.sweep_spec import mean_rate
from twinserve.traces import AdapterShape, LoRAAdapters, TraceRequest, assign_loras, first_n, load_trace
from twinserve.traces.transforms import scale_time

MODEL, HARDWARE, TRACE = "llama-3.1-8b", "h100-sxm", "azure-conv"


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    policy: str
    max_loras: int | None  # None: the base model, LoRA disabled


def rows(max_loras: list[int], compare: list[int]) -> list[Row]:
    out = [Row("base model (no adapters)", "fcfs", None)]
    out += [Row(f"fcfs, max_loras={m}", "fcfs", m) for m in max_loras]
    out += [Row(f"lora_affinity, max_loras={m}", "lora_affinity", m) for m in compare]
    return out


def run_row(row: Row, base: list[TraceRequest], lora: list[TraceRequest],
            adapters: LoRAAdapters) -> str:
    t0 = time.perf_counter()
    if row.max_loras is None:
        result = simulate(SimConfig(model=MODEL, hardware=HARDWARE), base)
    else:
        cfg = SimConfig(model=MODEL, hardware=HARDWARE, enable_lora=True, max_loras=row.max_loras,
                        max_lora_rank=adapters.default.rank, scheduling_policy=row.policy)
        result = simulate(cfg, lora, adapters=adapters)
    s, wall = result.summary, time.perf_counter() - t0
    loads, load_s = s.get("lora_loads", 0), s.get("lora_load_time_s", 0.0)
    return (f"{row.label:<30} {s['request_throughput']:>7.2f} {s['p99_ttft_ms'] / 1e3:>10.2f} "
            f"{s['mean_ttft_ms'] / 1e3:>10.2f} {s['mean_e2el_ms'] / 1e3:>10.2f} {loads:>6} "
            f"{load_s:>7.2f} {wall:>7.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=3000, help="the trace's first N requests")
    p.add_argument("--time-scale", type=float, default=2.0, help="replay K times as fast")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--compare", type=int, nargs="+", default=[4, 8],
                   help="max_loras values where lora_affinity runs beside fcfs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    base = scale_time(first_n(load_trace(TRACE), args.num_requests), args.time_scale)
    lora = assign_loras(base, {f"lora{i}": 1.0 for i in range(args.adapters)}, seed=args.seed)
    adapters = LoRAAdapters(AdapterShape(args.rank))
    print(f"{TRACE}: first {len(base)} requests x{args.time_scale:g} time scale = "
          f"{mean_rate(base):.2f} req/s; {args.adapters} adapters (rank {args.rank}, all seven "
          f"projections, equal weights, seed {args.seed}); {MODEL} on {HARDWARE} (roofline profile)")
    print(f"{'configuration':<30} {'req/s':>7} {'p99 TTFT s':>10} {'mean TTFT':>10} "
          f"{'mean E2EL':>10} {'loads':>6} {'load s':>7} {'wall s':>7}")
    t0 = time.perf_counter()
    for row in rows(args.max_loras, args.compare):
        print(run_row(row, base, lora, adapters), flush=True)
    print("TTFT and E2EL in seconds; loads: adapters copied into a device slot, load s: the "
          "seconds charged for them (bytes / PCIe bandwidth)")
    print(f"total wall time {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
