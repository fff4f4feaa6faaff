"""Policy sweep: FCFS, priority and VTC fairness x six request rates on the Azure conv trace
(Llama-3-8B, H100 SXM; the spec is examples/sweep_azure.toml). Prints the sweep's wall time, each
policy's capacity under the spec's SLO, and the fairness between a heavy (80%) and a light (20%)
tenant: Jain's index over tenant service and each tenant's TTFT.

    python -m twinserve.benchmarks.policy_sweep [--workers 2] [--backend local|ray] [--out DIR]

Without ``--out`` the sweep runs in a fresh temporary folder, so the wall time is that of every point;
with ``--out`` an earlier run there is resumed (and only the missing points are timed).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import pandas as pd

from twinserve.entrypoints.cli.sweep import sweep_and_report
from twinserve.simulator.capacity import find_capacity
from twinserve.simulator.sweep import BACKENDS
from twinserve.simulator.sweep_spec import SweepSpec, load_spec

DEFAULT_SPEC = Path(__file__).resolve().parents[1] / "examples" / "sweep_azure.toml"
TENANTS = ("light", "heavy")


def describe(spec: SweepSpec, sweep: pd.DataFrame, workers: int, backend: str) -> str:
    total = int(sweep["num_requests_run"].sum())
    wall = sweep.attrs["wall_time_s"]
    first = sweep.iloc[0]
    axes = " x ".join(f"{len(values)} {key}" for key, values in spec.grid.items())
    return "\n".join([
        f"policy sweep: {len(sweep)} points ({axes})"
        f", {first['trace']} first {first['num_requests_run']} requests, {first['model']} on "
        f"{first['hardware']}",
        f"wall time: {wall:.1f} s for {sweep.attrs['points_run']} points run, backend {backend}, "
        f"{workers} workers ({total} requests in all; {total / wall:.0f} simulated requests per "
        f"wall-clock second)" if sweep.attrs["points_run"] == len(sweep) else
        f"wall time: {wall:.1f} s ({sweep.attrs['points_run']} of {len(sweep)} points run; "
        f"the rest resumed)"])


def capacity_table(spec: SweepSpec, sweep: pd.DataFrame) -> str:
    if spec.slo is None:
        raise ValueError(f"{spec.source}: the policy sweep needs an [slo] section.")
    slos = ", ".join(f"{k} <= {v:g} ms" for k, v in spec.slo.slos_ms.items())
    cap = find_capacity(sweep, spec.slo.target, ["scheduling_policy"])
    attainment = sweep.pivot_table(index="scheduling_policy", columns="request_rate",
                                   values="slo_attainment", sort=False)
    return "\n".join([
        f"\nSLO: {slos} for {spec.slo.target:.0%} of requests. Fraction meeting it by request rate:",
        attainment.to_string(float_format=lambda x: f"{x:.3f}"),
        "\ncapacity (req/s; interpolated between the grid's rates):",
        cap.to_string(index=False, float_format=lambda x: f"{x:.2f}")])


def fairness_table(sweep: pd.DataFrame) -> str:
    columns = {"scheduling_policy": "policy", "request_rate": "rate", "jain_index": "jain",
               "request_throughput": "req/s"}
    for tenant in TENANTS:
        columns[f"tenant_{tenant}_mean_ttft_ms"] = f"{tenant} mean TTFT ms"
        columns[f"tenant_{tenant}_p90_ttft_ms"] = f"{tenant} p90 TTFT ms"
    missing = [c for c in columns if c not in sweep.columns]
    if missing:
        return f"\nno fairness figures: the sweep lacks {', '.join(missing)} (tenants not assigned?)"
    table = sweep[list(columns)].rename(columns=columns).sort_values(["rate", "policy"])
    return "\n".join([
        "\nfairness between tenants (Jain's index over tenant service, input + 2 x output tokens):",
        table.to_string(index=False, float_format=lambda x: f"{x:.4g}")])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--spec", type=Path, default=DEFAULT_SPEC)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--backend", choices=BACKENDS, default="local")
    ap.add_argument("--out", type=Path, help="output folder (default: a fresh temporary one)")
    args = ap.parse_args()
    spec = load_spec(args.spec)
    with tempfile.TemporaryDirectory(prefix="policy_sweep_") as tmp:
        out = args.out or Path(tmp)
        sweep = sweep_and_report(spec, out, backend=args.backend, workers=args.workers,
                                 progress=False, report=args.out is not None)
        print(describe(spec, sweep, args.workers, args.backend))
        print(capacity_table(spec, sweep))
        print(fairness_table(sweep))
        if args.out is not None:
            print(f"\nwrote {out / 'sweep.csv'}, {out / 'capacity.csv'}, {out / 'report.html'}")


if __name__ == "__main__":
    main()
