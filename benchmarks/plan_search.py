"""The planner's search on the Azure conv trace: Llama-3-8B and Llama-3-70B across A100-80GB,
H100-SXM and H200, up to 8 GPUs, TTFT-P90 <= 2 s and TPOT-P99 <= 100 ms (Vidur-Search's question).
Prints, per model: configurations in the space, pruned, dominated, searched, replays run (and how
many stopped early), wall time, and the answer.

    python -m twinserve.benchmarks.plan_search [--num-requests N] [--duration S] [--workers W]
        [--max-num-seqs 128,256] [--max-num-batched-tokens 2048,8192] [--out DIR]
        [--disaggregation off,1P1D,2P1D,1P2D] [--hardware h100-sxm]
        [--prefill-max-num-batched-tokens none,16384] [--decode-max-num-seqs none,512]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from twinserve.planner.output import top_table, write_outputs
from twinserve.planner.plan import run_plan
from twinserve.planner.space import POOL_COLUMNS as POOL_AXES
from twinserve.planner.spec import parse_plan

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023"


def plan_spec(model: str, num_requests: int, duration: float, trace: str, seqs: list[int],
              tokens: list[int], slack: float, disaggregation: list[str] | None = None,
              hardware: list[str] | None = None,
              pools: dict[str, list[int | None]] | None = None) -> dict:
    return {"model": model, "hardware": hardware or ["a100-80gb", "h100-sxm", "h200"], "max_gpus": 8,
            "workload": {"trace": trace, "num_requests": num_requests, "duration_s": duration},
            "slo": {"ttft_p90_ms": 2000, "tpot_p99_ms": 100},
            "space": {"replicas": [1, 2, 4, 8], "router": ["round-robin"], "max_num_seqs": seqs,
                      "max_num_batched_tokens": tokens,
                      "disaggregation": disaggregation or ["off"], **(pools or {})},
            "search": {"tolerance": 0.1, "base_rps": 2.0, "min_rps": 0.1, "max_rps": 400,
                       "dominance_slack": slack}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=3000)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trace", default="azure-conv",
                        help=f"bundled name or file (the shared copy: {TRACE})")
    parser.add_argument("--max-num-seqs", default="128,256")
    parser.add_argument("--max-num-batched-tokens", default="2048,8192")
    parser.add_argument("--models", default="llama-3-8b,llama-3-70b")
    parser.add_argument("--dominance-slack", type=float, default=1.5, help="0: search everything")
    parser.add_argument("--disaggregation", default="off",
                        help="aggregated (off) and/or xPyD shapes, e.g. off,1P1D,2P1D,1P2D")
    parser.add_argument("--hardware", default="a100-80gb,h100-sxm,h200")
    for axis in POOL_AXES:
        parser.add_argument(f"--{axis.replace('_', '-')}", default="none",
                            help="an xPyD pool's own values (none: the deployment's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="plan-search-"))
    for model in args.models.split(","):
        spec = parse_plan(plan_spec(model, args.num_requests, args.duration, args.trace,
                                    _ints(args.max_num_seqs), _ints(args.max_num_batched_tokens),
                                    args.dominance_slack, args.disaggregation.split(","),
                                    args.hardware.split(","),
                                    {a: _pool_values(getattr(args, a)) for a in POOL_AXES}))
        t0 = time.perf_counter()
        result = run_plan(spec, out / model, workers=args.workers)
        write_outputs(result, spec, out / model)
        stats = result.stats
        print(f"\n== {model}: {stats['configurations']} configurations, {stats['pruned_memory']} pruned "
              f"by memory, {stats['dominated']} dominated, {stats['fitted'] + stats['no_capacity']} "
              f"searched; {stats['replays_run']} replays ({stats['stopped_early']} stopped early); "
              f"{time.perf_counter() - t0:.1f} s wall, {_replay_seconds(out / model):.1f} s of replays")
        print(top_table(result, 3))
        _print_pd(result)
    print(f"\noutputs: {out}")


def _print_pd(result) -> None:
    """The best aggregated and the best xPyD deployment, when the plan searched both."""
    fitted = result.fitted()
    best = {kind: next((r for r in fitted if (r["prefill_instances"] > 0) == pd), None)
            for kind, pd in (("aggregated", False), ("disaggregated", True))}
    if all(best.values()):
        for kind, row in best.items():
            print(f"best {kind}: {row['name']}: {row['capacity_rps']:.4g} req/s, "
                  f"${row['cost_per_m_output_tokens']:.4g} per M output tokens")


def _replay_seconds(folder: Path) -> float:
    """The replays' own wall time, summed over the point files (the search's CPU work)."""
    return sum(json.loads(p.read_text())["wall_time_s"] for p in folder.glob("points/*/r*.json"))


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _pool_values(text: str) -> list[int | None]:
    return [None if v == "none" else int(v) for v in text.split(",")]


if __name__ == "__main__":
    main()
