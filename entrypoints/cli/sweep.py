"""``twinserve sweep SPEC.toml``: simulate a grid of configurations, find each one's capacity, report.

    OUT/
      sweep_spec.json        the validated spec
      points/<name>-<id>/    one run folder per grid point (``core.run_dir``); id = hash of its config
      sweep.csv              one row per point: config columns, summary metrics, SLO attainment
      capacity.csv           per configuration: the highest request rate meeting the SLO target
      report.html            ``reports.write_report`` over representative points, with the sweep table

The grid (``simulator.sweep_spec``), its execution in local processes or Ray tasks, resuming
where a previous run stopped (``simulator.sweep``), the capacity search (``simulator.capacity``)
and the report (``reports.sweep_report``) live beside their concepts; this module is the command.

Capacity (as Vidur-Search defines it): the highest request rate at which the fraction of requests
meeting every SLO (``slo_attainment``) is at least the target; between that grid rate and the next
one (which misses), the crossing is interpolated linearly.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

from twinserve.simulator.sweep import BACKENDS, run_sweep, sweep_capacity
from twinserve.simulator.sweep_spec import SweepSpec, load_spec


def summary_text(spec: SweepSpec, sweep: pd.DataFrame, capacity: pd.DataFrame | None) -> str:
    """The compact printout: SLO attainment per configuration and rate, then the capacities."""
    lines = [(f"{sweep.attrs.get('points_run', '?')} of {len(sweep)} points run in "
              f"{sweep.attrs.get('wall_time_s', math.nan):.1f} s")]
    if spec.slo is not None and "request_rate" in spec.grid:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in spec.slo.slos_ms.items())
        table = sweep.pivot_table(index="series", columns="request_rate", values="slo_attainment",
                                  sort=False)
        lines += [(f"\nfraction of requests meeting {slos} (target {spec.slo.target:g}), "
                   "by request rate (req/s):"), table.to_string(float_format=lambda x: f"{x:.3f}")]
    if capacity is not None:
        shown = capacity[["series", "capacity_rps", "max_rate_meeting_slo", "status"]]
        lines += ["\ncapacity (req/s):",
                  shown.to_string(index=False, float_format=lambda x: f"{x:.2f}")]
    return "\n".join(lines)


def sweep_and_report(spec: SweepSpec | str | Path, out: Path, backend: str = "local",
                     workers: int | None = None, address: str | None = None,
                     progress: bool = True, report: bool = True) -> pd.DataFrame:
    """``simulator.sweep.run_sweep``, the printout (with ``progress``) and ``report.html`` (with
    ``report``); returns the sweep table."""
    spec = spec if isinstance(spec, SweepSpec) else load_spec(spec)
    sweep = run_sweep(spec, out, backend=backend, workers=workers, address=address,
                      progress=progress)
    capacity = sweep_capacity(spec, sweep)
    if progress:
        print(summary_text(spec, sweep, capacity))
    if report:
        from twinserve.reports.sweep_report import write_sweep_report  # plotly: only when asked
        slos = spec.slo.slos_ms if spec.slo is not None else None
        write_sweep_report(sweep, capacity, out, slos, spec.title)
    return sweep


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``twinserve sweep``."""
    parser.add_argument("spec", type=Path, help="sweep spec (TOML), e.g. examples/sweep_azure.toml")
    parser.add_argument("--backend", choices=BACKENDS, default="local",
                        help="local processes (default) or Ray tasks")
    parser.add_argument("--address", help="Ray cluster address (--backend ray; default: start a "
                        "local cluster). Its nodes must see --out (a shared file system)")
    parser.add_argument("--workers", type=int,
                        help="points run at once (default: the CPU count; local Ray cluster's CPUs)")
    parser.add_argument("--out", type=Path,
                        help="output folder (default: sweeps/<spec file stem>); rerunning resumes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or table")
    parser.add_argument("--no-report", action="store_true", help="skip report.html")


def run_sweep_cli(args: argparse.Namespace) -> int:
    """Runs ``twinserve sweep``; returns the exit status (2 for a bad spec or flag)."""
    out = args.out if args.out is not None else Path("sweeps") / args.spec.stem
    try:
        sweep_and_report(args.spec, out, backend=args.backend, workers=args.workers,
                         address=args.address, progress=not args.no_progress,
                         report=not args.no_report)
    except ValueError as exc:
        print(f"twinserve sweep: error: {exc}", file=sys.stderr)
        return 2
    written = ["sweep.csv", *(["report.html"] if not args.no_report else [])]
    print(f"wrote {', '.join(str(out / name) for name in written)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twinserve sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(parser)
    return run_sweep_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
