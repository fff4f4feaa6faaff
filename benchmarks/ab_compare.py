"""This checkout against another revision, side by side: the twin's replay speed and the
scheduler's overhead per request-step, in interleaved rounds (the machine is shared and noisy).

    git worktree add /tmp/base main            # the revision to compare with
    python -m twinserve.benchmarks.ab_compare --base /tmp/base --rounds 3

Each round runs both trees once each (the order alternates), every figure in a fresh process
whose ``twinserve`` is that tree (``PYTHONPATH``). Figures: CPU seconds of the whole Azure conv
trace and of its first 2,000 requests through ``SimConfig(hardware="h100-sxm",
max_num_seqs=256, max_num_batched_tokens=8192)`` on the H100's roofline (settings written out,
so both trees run the same engine whatever their defaults), and the scheduler benchmark's
microseconds per running request per step (256 running, fcfs). The table gives each tree's
median and the ratio of the medians (this / base); above 1 is slower.

``--cli``: instead, the command line's wall time, start-up, trace reading, writing the run
folder and the process's exit included: ``python -m twinserve.entrypoints.cli.main simulate --trace
azure-conv --out DIR`` on its defaults (progress bar on, to a pipe), whole and with
``--num-requests 2000``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIM_SNIPPET = """
import time
from twinserve.simulator import SimConfig, simulate
from twinserve.traces import first_n, load_trace
trace = load_trace("azure-conv")
if {n} > 0:
    trace = first_n(trace, {n})
cfg = SimConfig(hardware="h100-sxm", max_num_seqs=256, max_num_batched_tokens=8192)
t0 = time.process_time()
result = simulate(cfg, trace)
print("RESULT", time.process_time() - t0, len(result.records))
"""
FIGURES = {
    "sim azure-conv whole trace (CPU s)": ("-c", SIM_SNIPPET.format(n=0)),
    "sim azure-conv 2,000 requests (CPU s)": ("-c", SIM_SNIPPET.format(n=2000)),
    "scheduler us/req/step (256 running, fcfs)": (
        "-m", "twinserve.benchmarks.scheduler_overhead", "--running", "256", "--repeats", "3",
        "--policy", "fcfs"),
}

CLI = ("-m", "twinserve.entrypoints.cli.main", "simulate", "--trace", "azure-conv")  # as a user runs it
CLI_FIGURES = {
    "cli simulate azure-conv whole trace (wall s)": (*CLI, "--out", "{out}"),
    "cli simulate --num-requests 2000 (wall s)": (*CLI, "--num-requests", "2000", "--out", "{out}"),
}


def package_dir(tree: Path, tmp: Path, name: str) -> Path:
    """A folder holding ``twinserve`` -> ``tree``, for ``PYTHONPATH``."""
    root = tmp / name
    root.mkdir()
    (root / "twinserve").symlink_to(tree.resolve())
    return root


def run_figure(pythonpath: Path, argv: tuple[str, ...]) -> float:
    """The figure a run prints; for a CLI figure (``{out}`` in ``argv``) the run's wall time."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, *(out if a == "{out}" else a for a in argv)]
        start = time.perf_counter()
        proc = subprocess.run(command, env=env, capture_output=True, text=True,
                              cwd=tempfile.gettempdir(), check=False)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:2]} failed under {pythonpath}:\n{proc.stderr[-2000:]}")
    if "{out}" in argv:
        return wall
    found = re.search(r"^RESULT (\S+)", proc.stdout, re.M)
    if found:
        return float(found.group(1))
    rows = re.findall(r"^fcfs\s+\d+\s+(\S+)", proc.stdout, re.M)
    if not rows:
        raise RuntimeError(f"no figure in the output of {argv[:2]}:\n{proc.stdout[-2000:]}")
    return float(rows[0])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, type=Path, help="checkout of the other revision")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--figures", nargs="+", default=None, choices=[*FIGURES, *CLI_FIGURES])
    p.add_argument("--cli", action="store_true",
                   help="the command line's wall time (CLI_FIGURES) instead of the default figures")
    args = p.parse_args(argv)
    if args.figures is None:
        args.figures = list(CLI_FIGURES if args.cli else FIGURES)
    figures = {**FIGURES, **CLI_FIGURES}
    this = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": package_dir(this, Path(tmp), "this"),
                 "base": package_dir(args.base, Path(tmp), "base")}
        results: dict[str, dict[str, list[float]]] = {f: {"this": [], "base": []}
                                                      for f in args.figures}
        for k in range(args.rounds):
            order = ("this", "base") if k % 2 == 0 else ("base", "this")
            for figure in args.figures:
                for tree in order:
                    results[figure][tree].append(run_figure(trees[tree], figures[figure]))
                print(f"round {k + 1}: {figure}: this {results[figure]['this'][-1]:.3f}, "
                      f"base {results[figure]['base'][-1]:.3f}", flush=True)
    print(f"\n{'figure':<44} {'this':>9} {'base':>9} {'this/base':>10}   (medians of "
          f"{args.rounds} rounds)")
    for figure, by_tree in results.items():
        mine, base = statistics.median(by_tree["this"]), statistics.median(by_tree["base"])
        print(f"{figure:<44} {mine:>9.3f} {base:>9.3f} {mine / base:>10.3f}")


if __name__ == "__main__":
    main()
