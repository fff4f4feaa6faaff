"""How fast the SimPy twin replays a trace, and whether its cost grows linearly with the requests.

    python -m twinserve.benchmarks.sim_speed                       # full Azure conv 1x + scaling
    python -m twinserve.benchmarks.sim_speed --num-requests 2000 --base-requests 1000 --scale 1 4
    python -m twinserve.benchmarks.sim_speed --skip-full --profile
    python -m twinserve.benchmarks.sim_speed --cli --repeats 5        # the `simulate` command

1. The whole Azure LLM 2023 conversation trace (19,366 requests, ~1 h) through ``SimConfig(**BASE)``
   (Llama-3-8B on one H100's roofline, FCFS, prefix caching on): wall and CPU seconds, requests, engine steps,
   request-steps (the sum over steps of the sequences scheduled: the work the scheduler does).
2. Linearity: ``k`` copies of a base slice, each time-compressed by ``k`` (``repeat`` then
   ``scale_time``), so the trace keeps its duration and carries ``k`` times the requests at ``k``
   times the rate. One H100 saturates long before 16x, and a saturated engine runs fewer, fuller
   steps (and queues grow), so cost per request would mix two effects. The default therefore runs
   ``num_replicas = k`` (round-robin): load per replica stays that of the base slice and the cost
   per request-step should stay flat. ``--replicas one`` keeps one replica (the saturation case),
   ``--replicas both`` prints both.

3. ``--cli``: the ``twinserve simulate`` command itself (imports, trace, replay, run folder, in a
   subprocess of this interpreter), for 2,000 requests and the whole trace (``--cli-requests``):
   its user + sys CPU from ``resource.getrusage(RUSAGE_CHILDREN)`` (any process it forks
   included), beside the interpreter's start and the command's imports alone. The subprocesses
   cache bytecode under a temporary ``PYTHONPYCACHEPREFIX`` (warmed by a first, untimed run), as
   an installed package has its ``.pyc`` files: a host that sets ``PYTHONDONTWRITEBYTECODE``
   would otherwise compile every module on every start.

Figures are medians over ``--repeats`` runs; CPU is ``time.process_time`` (the machine is shared,
so wall time alone overstates the cost).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from twinserve.simulator import SimConfig, SimResult, simulate
from twinserve.traces import TraceRequest, first_n, load_trace, repeat, scale_time

TRACE = "azure-conv"
# the config the recorded figures ran on (written out: SimConfig's default is now a measured fit)
BASE = {"model": "llama-3-8b", "hardware": "h100-sxm"}


@dataclass(slots=True, frozen=True)
class Measurement:
    label: str
    requests: int
    steps: int
    request_steps: int
    sim_seconds: float
    wall_s: float  # medians over the repeats
    cpu_s: float
    cpu_min_s: float  # the least disturbed repeat (the machine is shared)

    @property
    def us_per_request(self) -> float:
        return self.cpu_s / self.requests * 1e6

    @property
    def us_per_request_step(self) -> float:
        return self.cpu_s / max(self.request_steps, 1) * 1e6


def timed(run: Callable[[], SimResult]) -> tuple[SimResult, float, float]:
    """One run with its wall and CPU seconds."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    result = run()
    return result, time.perf_counter() - wall0, time.process_time() - cpu0


def measure(label: str, cfg: SimConfig, trace: list[TraceRequest], repeats: int) -> Measurement:
    """Median wall and CPU seconds of ``repeats`` identical simulations."""
    return summarise(label, trace, [timed(lambda: simulate(cfg, trace)) for _ in range(repeats)])


def summarise(label: str, trace: list[TraceRequest],
              runs: list[tuple[SimResult, float, float]]) -> Measurement:
    """One row from repeated runs of the same simulation (medians, and the least CPU)."""
    result = runs[-1][0]
    cpus = [cpu for _, _, cpu in runs]
    return Measurement(label, len(trace), len(result.steps),
                       sum(result.steps.column("num_seqs")), float(result.summary["duration"]),
                       statistics.median(wall for _, wall, _ in runs), statistics.median(cpus),
                       min(cpus))


def compressed_copies(base: list[TraceRequest], k: int) -> list[TraceRequest]:
    """``k`` back-to-back copies of ``base`` replayed ``k`` times as fast: same span, k x rate."""
    return base if k == 1 else scale_time(repeat(base, k), float(k))


HEADER = (f"{'run':34s} {'requests':>9s} {'steps':>8s} {'req-steps':>10s} {'sim s':>8s} "
          f"{'wall s':>8s} {'cpu s':>8s} {'min cpu':>8s} {'us/req':>8s} {'us/req-step':>11s} "
          f"{'(min)':>7s} {'sim/cpu':>8s}")


def row(m: Measurement) -> str:
    return (f"{m.label:34s} {m.requests:9d} {m.steps:8d} {m.request_steps:10d} "
            f"{m.sim_seconds:8.1f} {m.wall_s:8.2f} {m.cpu_s:8.2f} {m.cpu_min_s:8.2f} "
            f"{m.us_per_request:8.1f} {m.us_per_request_step:11.2f} "
            f"{m.cpu_min_s / max(m.request_steps, 1) * 1e6:7.2f} {m.sim_seconds / m.cpu_s:8.1f}")


def scaling_rows(base: list[TraceRequest], scales: list[int], replicas: str,
                 repeats: int) -> dict[str, list[Measurement]]:
    """Measurements per replica mode: ``per-load`` (k replicas for k x) and/or ``one``.

    Repeats are interleaved across the scales (1x, 4x, 16x, 1x, 4x, ...) so that a burst of load
    from other users of the machine does not land on one scale only."""
    modes = ("per-load", "one") if replicas == "both" else (replicas,)
    cases = [(mode, k) for mode in modes for k in scales]
    traces = {k: compressed_copies(base, k) for k in scales}
    runs: dict[tuple[str, int], list[tuple[SimResult, float, float]]] = {c: [] for c in cases}
    for _ in range(repeats):
        for mode, k in cases:
            cfg = SimConfig(**BASE, num_replicas=k if mode == "per-load" else 1)
            runs[(mode, k)].append(timed(lambda cfg=cfg, k=k: simulate(cfg, traces[k])))
    out: dict[str, list[Measurement]] = {}
    for mode, k in cases:
        label = f"{k}x base, {k if mode == 'per-load' else 1} replica(s)"
        out.setdefault(mode, []).append(summarise(label, traces[k], runs[(mode, k)]))
        print(row(out[mode][-1]), flush=True)
    return out


def per_step(m: Measurement) -> float:
    """Least CPU seconds per request-step over the repeats."""
    return m.cpu_min_s / max(m.request_steps, 1)


def linearity_note(rows: list[Measurement]) -> list[str]:
    """CPU per request-step and per request at each scale, relative to the first row."""
    ref = rows[0]
    return [f"{m.label}: {m.us_per_request_step / ref.us_per_request_step:.2f}x per request-step "
            f"(min CPU: {per_step(m) / per_step(ref):.2f}x), "
            f"{m.us_per_request / ref.us_per_request:.2f}x per request "
            f"(requests {m.requests / ref.requests:.0f}x, CPU {m.cpu_s / ref.cpu_s:.1f}x)"
            for m in rows[1:]]


def profile(cfg: SimConfig, trace: list[TraceRequest], top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    simulate(cfg, trace)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def child_cpu(command: list[str], env: dict[str, str]) -> float:
    """User + sys CPU seconds of ``command`` and everything it waited for (its forks)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cli_cases(requests: list[str], out: Path) -> dict[str, list[str]]:
    """The commands timed: the interpreter alone, the command's imports, and ``simulate`` over
    the first N requests of the trace (``all``: the whole trace) on ``BASE``."""
    py = sys.executable
    cases = {"python -c pass": [py, "-c", "pass"],
             # as the command imports them (cli.main.ONE_BLAS_THREAD)
             "imports (cli + simulator)": [py, "-c", "import os; os.environ.setdefault("
                                           "'OPENBLAS_NUM_THREADS', '1'); import "
                                           "twinserve.entrypoints.cli.main, twinserve.simulator, "
                                           "twinserve.traces"]}
    for n in requests:
        limit = [] if n == "all" else ["--num-requests", n]
        cases[f"simulate {n} requests"] = [
            py, "-m", "twinserve.entrypoints.cli.main", "simulate", "--trace", TRACE, *limit,
            "--model", BASE["model"], "--hardware", BASE["hardware"], "--out", str(out / n),
            "--disable-tqdm"]
    return cases


def cli_rows(requests: list[str], repeats: int) -> list[str]:
    """Median (and least) CPU of each case over ``repeats``, interleaved across the cases."""
    with tempfile.TemporaryDirectory(prefix="sim-speed-cli-") as tmp:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        cases = cli_cases(requests, Path(tmp))
        for command in cases.values():  # untimed: compiles and caches the bytecode
            child_cpu(command, env)
        cpu: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(repeats):
            for name, command in cases.items():
                cpu[name].append(child_cpu(command, env))
    return [f"{name:34s} cpu s median {statistics.median(v):6.3f}  min {min(v):6.3f}  "
            f"({', '.join(f'{x:.3f}' for x in v)})" for name, v in cpu.items()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests of the trace for the 1x run (default: all 19,366)")
    p.add_argument("--base-requests", type=int, default=2000,
                   help="slice of the trace the scaling runs copy (default 2000)")
    p.add_argument("--scale", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--replicas", choices=("per-load", "one", "both"), default="per-load")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--skip-full", action="store_true", help="only the scaling runs")
    p.add_argument("--profile", action="store_true",
                   help="cProfile one run of the base slice and print the top entries")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--cli", action="store_true",
                   help="only time the `twinserve simulate` command in subprocesses (CPU)")
    p.add_argument("--cli-requests", nargs="+", default=["2000", "all"],
                   help="request counts for --cli (all: the whole trace)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cli:
        print(f"`twinserve simulate` on {TRACE}, {BASE['model']} on {BASE['hardware']}: user + sys "
              f"CPU of the subprocess and its children; repeats {args.repeats}")
        print("\n".join(cli_rows(args.cli_requests, args.repeats)))
        return
    trace = load_trace(TRACE)
    print(f"trace {TRACE}: {len(trace)} requests over {trace[-1].arrival_time:.0f} s; "
          f"config: SimConfig(**BASE) = llama-3-8b on h100-sxm, fcfs, prefix caching on; "
          f"repeats {args.repeats}")
    print(HEADER)
    if not args.skip_full:
        full = trace if args.num_requests is None else first_n(trace, args.num_requests)
        print(row(measure(f"{TRACE} 1x ({len(full)} req)", SimConfig(**BASE), full, args.repeats)),
              flush=True)
    base = first_n(trace, args.base_requests)
    for mode, rows in scaling_rows(base, args.scale, args.replicas, args.repeats).items():
        if len(rows) > 1:
            print(f"\nlinearity, replicas {mode} (CPU relative to {rows[0].label}):")
            print("\n".join(linearity_note(rows)))
    if args.profile:
        print(f"\ncProfile of one run of the {len(base)}-request base slice:")
        print(profile(SimConfig(**BASE), base, args.top))


if __name__ == "__main__":
    main()
