"""Fidelity of the twin: the same Azure-conv slice replayed on the real engine and in simulation.

    python -m twinserve.benchmarks.fidelity [--out runs/fidelity] [--num-requests 200] \\
        [--max-model-len 128] [--max-output-tokens 32] [--time-scale 0.4] [--dtype auto] \\
        [--scenarios fcfs,fair,light,overload] [--real-repeats 3] [--micro]

1. Real replays (``twinserve validate``, prefix caching and chunked prefill on), into
   ``OUT/real/<scenario>-<round>``, in ``--real-repeats`` interleaved rounds: each round replays the
   calibration slice and each target scenario once, so that the machine's drift (on a shared host
   the engine's speed moved by +-8% between runs) falls on calibration and targets alike.
   - ``calib``: a *different* slice of the trace (requests from ``--calib-window``, fcfs, the
     targets' load), for the out-of-sample calibration; with ``--calib-light`` also ``calib-light``,
     the same slice at a third of that load, in the first round only;
   - ``fcfs`` and ``fair`` (tenants heavy=3, light=1) at ``--time-scale`` (near saturation): the
     targets, compared with the median of their rounds;
   - ``light`` at a third of that load and ``overload`` at twice the load with a KV cache cut to
     ``--overload-blocks`` blocks (preemptions), in the first round only.
2. Profiles, each fitted by ``twinserve calibrate --from-run`` at the median replay's speed:
   ``from-run`` on the calibration replays (``OUT/profile.json``), ``loo`` on every other
   scenario's replays plus those, ``self`` on the scenario's own (the twin's floor of error).
   ``--micro`` adds the micro-benchmark profile (``calibrate --quick``); ``--profile`` replaces
   the calibration replays by a given profile.
3. Each scenario simulated with each profile against its real replays (``validate --reuse-real``)
   and the table of relative errors (sim - real) / real per scenario and metric, with the targets
   (throughput and mean E2EL 5%, mean TTFT, mean TPOT and p90 E2EL 10%): ``OUT/fidelity.csv``.
4. The real engine against itself (profile ``real-run``, scenarios with 3+ replays): each replay's
   error against the median of the other replays, the median of their sizes. No twin can be
   expected to land closer to the real median than the replays land to each other.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from twinserve.entrypoints.cli.main import main as cli
from twinserve.reports.fidelity import TARGETS, error_row
from twinserve.reports.repeatability import error_pct, left_out

SCENARIOS = ("fcfs", "fair", "light", "overload")
CALIBRATION = "calib"
CALIBRATION_LIGHT = "calib-light"
LIGHT_LOAD = 1 / 3  # of the targets' arrival rate, for ``light`` and ``calib-light``
TARGET_SCENARIOS = ("fcfs", "fair")  # the targets; the others show how errors move
SHOWN = ("request_throughput", "mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms", "p90_e2el_ms",
         "num_preemptions", "prefix_cache_hit_rate", "replayed_step_time_s")


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--model", args.model] if args.model else []
    flags += ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--threads", str(args.threads)]
    return flags


def _workload(args: argparse.Namespace, time_scale: float, window: str | None = None) -> list[str]:
    flags = ["--trace", args.trace, "--num-requests", str(args.num_requests),
             "--time-scale", f"{time_scale:g}", "--max-output-tokens", str(args.max_output_tokens)]
    return flags + (["--time-window", window] if window else [])


def scenario_flags(name: str, args: argparse.Namespace) -> list[str]:
    s = args.time_scale
    if name in (CALIBRATION, CALIBRATION_LIGHT):
        calib = argparse.Namespace(**{**vars(args), "num_requests": args.calib_requests
                                      or args.num_requests})
        scale = s if name == CALIBRATION else s * LIGHT_LOAD
        return _workload(calib, scale, args.calib_window) + ["--policy", "fcfs"]
    if name == "fcfs":
        return _workload(args, s) + ["--policy", "fcfs"]
    if name == "fair":
        return _workload(args, s) + ["--policy", "fair", "--tenants", "heavy=3,light=1"]
    if name == "light":
        return _workload(args, s * LIGHT_LOAD) + ["--policy", "fcfs"]
    if name == "overload":
        return _workload(args, 2 * s) + ["--policy", "fcfs", "--num-gpu-blocks-override",
                                         str(args.overload_blocks)]
    raise ValueError(f"unknown scenario {name!r}; known: {CALIBRATION}, {', '.join(SCENARIOS)}")


def _model(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model] if args.model else []


def replay_rounds(names: list[str], args: argparse.Namespace, engine: list[str],
                  out: Path) -> dict[str, list[Path]]:
    """The real runs of each scenario (and of the calibration slice unless ``--profile``), replayed
    round by round; with ``--resume`` a replay already on disk is kept."""
    repeats = {name: args.real_repeats if name in TARGET_SCENARIOS else 1 for name in names}
    if not args.profile:
        light = {CALIBRATION_LIGHT: 1} if args.calib_light else {}
        repeats = {CALIBRATION: args.real_repeats, **light, **repeats}
    runs: dict[str, list[Path]] = {name: [] for name in repeats}
    for round_ in range(1, max(repeats.values()) + 1):
        for name in (n for n, k in repeats.items() if round_ <= k):
            folder = out / "real" / f"{name}-{round_}"
            if not (args.resume and (folder / "real" / "step_features.csv").is_file()):
                run_cli(["validate", *scenario_flags(name, args), *engine, "--profile", "cpu",
                      "--out", str(folder), "--quiet"])
            runs[name].append(folder / "real")
    return runs


def fit_profiles(names: list[str], runs: dict[str, list[Path]], args: argparse.Namespace,
                 out: Path) -> dict[str, dict[str, str]]:
    """Per scenario, the profiles it is simulated with: label -> profile name or path."""
    shared: dict[str, str] = {}
    if args.profile:
        shared["given"] = args.profile
    else:
        calibration = runs[CALIBRATION] + runs.get(CALIBRATION_LIGHT, [])
        shared["from-run"] = _fit(calibration, out / "profile.json", args)
    if args.micro:
        path = out / "profile-micro.json"
        if not (args.resume and path.is_file()):
            run_cli(["calibrate", "--quick", *_engine_flags(args), "--out", str(path),
                  "--samples-out", str(out / "profile-micro-samples.csv")])
        shared["micro"] = str(path)
    profiles = {name: dict(shared) for name in names}
    for name in names:
        if args.loo and len(names) > 1:
            others = [d for n, dirs in runs.items() if n != name for d in dirs]
            profiles[name]["loo"] = _fit(others, out / f"profile-loo-{name}.json", args)
        if args.self_fit:
            profiles[name]["self"] = _fit(runs[name], out / f"profile-self-{name}.json", args)
    return profiles


def _fit(runs: list[Path], path: Path, args: argparse.Namespace) -> str:
    run_cli(["calibrate", "--from-run", *map(str, runs), "--out", str(path), *_model(args)])
    return str(path)


def reproducibility_rows(name: str, runs: list[Path]) -> list[dict[str, object]]:
    """Per target metric, the median over replays of |replay - median(other replays)| / median(other
    replays), in %, as a ``real-run`` row of the table (none below 3 replays)."""
    if len(runs) < 3:
        return []
    summaries = [json.loads((d / "summary.json").read_text()) for d in runs]
    rows: list[dict[str, object]] = []
    for metric, target in TARGETS:
        values = [float(s[metric]) for s in summaries if s.get(metric) is not None]
        errors = [abs(e) for e in (error_pct(v, statistics.median(rest))
                                   for v, rest in left_out(values)) if not math.isnan(e)]
        err = statistics.median(errors) if errors else math.nan
        within = "" if target is None or math.isnan(err) else str(err <= target).lower()
        row = error_row(metric, values, math.nan, target)  # the real median, min, max and count
        rows.append({"scenario": name, "profile": "real-run", **row, "sim": "",
                     "rel_error_pct": err, "within_target": within})
    return rows


def read_errors(path: Path) -> dict[str, dict[str, str]]:
    with open(path) as f:
        return {row["metric"]: row for row in csv.DictReader(f)}


def run_cli(argv: list[str], run: Callable[[list[str]], int] = cli, note: str = "") -> None:
    """Runs one ``twinserve`` command in this process (through ``run``: the command line's
    entry point unless given), echoing it, ``note`` and its time to stderr."""
    print("+ twinserve " + " ".join(argv) + (f"  # {note}" if note else ""), file=sys.stderr,
          flush=True)
    t0 = time.perf_counter()
    rc = run(argv)
    if rc != 0:
        raise SystemExit(f"twinserve {argv[0]} failed with exit status {rc}")
    print(f"  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", default="runs/fidelity")
    p.add_argument("--model", default=None, help="HF model directory (default: bundled SmolLM2)")
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--time-scale", type=float, default=0.4,
                   help="arrival speed-up of the near-saturation scenarios (tune to the machine: "
                        "where the simulated queue time starts to grow; here the mean TTFT grew "
                        "from 0.67 s at 0.3 to 0.93 s at 0.4 and 1.8 s at 0.5)")
    p.add_argument("--real-repeats", type=int, default=3,
                   help="rounds of real replays of the calibration slice and each target scenario "
                        "(fcfs, fair); the targets' medians are compared")
    p.add_argument("--overload-blocks", type=int, default=None,
                   help="KV blocks in the overload scenario (default: 4 full-length requests)")
    p.add_argument("--calib-window", default="120:",
                   help="trace seconds the calibration replay takes its requests from")
    p.add_argument("--calib-requests", type=int, default=None,
                   help="requests of the calibration replay (default --num-requests)")
    p.add_argument("--calib-light", action="store_true",
                   help="also calibrate on one replay of the calibration slice at light load "
                        "(a third of --time-scale), so the profile sees small decode batches")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--micro", action="store_true",
                   help="also evaluate the micro-benchmark profile (calibrate --quick)")
    p.add_argument("--profile", default=None, help="use this profile, skip the calibration replays")
    p.add_argument("--no-loo", dest="loo", action="store_false",
                   help="skip the leave-one-out profiles (fitted on the other scenarios' runs)")
    p.add_argument("--no-self", dest="self_fit", action="store_false",
                   help="skip the in-sample profiles (fitted on the scenario's own runs)")
    p.add_argument("--resume", action="store_true",
                   help="reuse real runs already in OUT (re-simulate only)")
    args = p.parse_args(argv)
    if args.overload_blocks is None:
        args.overload_blocks = 4 * -(-args.max_model_len // 16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"--scenarios: unknown {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    t_start = time.perf_counter()
    engine = _engine_flags(args) + ["--enable-prefix-caching", "--enable-chunked-prefill"]
    runs = replay_rounds(names, args, engine, out)
    rows = []
    for name, profiles in fit_profiles(names, runs, args, out).items():
        for label, profile in profiles.items():
            folder = out / f"{name}-{label}"
            run_cli(["validate", *scenario_flags(name, args), *engine, "--profile", profile,
                  "--out", str(folder), "--quiet", "--reuse-real", *map(str, runs[name])])
            for row in read_errors(folder / "errors.csv").values():
                rows.append({"scenario": name, "profile": label, **row})
        rows += reproducibility_rows(name, runs[name])
    with open(out / "fidelity.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["scenario", "profile", "metric", "real", "sim", "rel_error_pct",
                               "target_pct", "within_target", "real_min", "real_max",
                               "real_runs"], lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    print(format_table(rows))
    print(f"fidelity table: {out / 'fidelity.csv'} ({time.perf_counter() - t_start:.0f} s)")
    return 0


def _short(metric: str) -> str:
    short = {"request_throughput": "req/s", "num_preemptions": "preempt",
             "prefix_cache_hit_rate": "cache_hit", "replayed_step_time_s": "steps"}
    return short.get(metric, metric.removesuffix("_ms"))


def format_table(rows: list[dict[str, str]]) -> str:
    """One line per scenario and profile: the signed error (%) of each metric; * marks a miss."""
    head = f"{'scenario':<10} {'profile':<9}" + "".join(f" {_short(m):>10}" for m in SHOWN)
    lines = ["sim vs real, relative error % (* = outside target); real-run: a replay against the "
             "median of the others, the median size", head]
    keyed: dict[tuple[str, str], dict[str, dict[str, str]]] = {}
    for r in rows:
        keyed.setdefault((r["scenario"], r["profile"]), {})[r["metric"]] = r
    for (scenario, profile), metrics in keyed.items():
        cells = []
        for m in SHOWN:
            r = metrics.get(m)
            if r is None or r["rel_error_pct"] == "":
                cells.append("n/a")
                continue
            err = float(r["rel_error_pct"])
            mark = "*" if r["within_target"] == "false" else " "
            cells.append(f"{err:+.1f}{mark}" if math.isfinite(err) else "nan")
        lines.append(f"{scenario:<10} {profile:<9}" + "".join(f" {c:>10}" for c in cells))
    per_tenant = [r for r in rows if r["metric"].startswith("mean_ttft_ms[")]
    if per_tenant:
        lines += ["", "mean TTFT per tenant (ms): real median, sim, error %"]
        lines += [f"{r['scenario']:<10} {r['profile']:<9} {r['metric'][13:-1]:<8} "
                  f"{float(r['real']):>9.0f} {float(r['sim']):>9.0f} "
                  f"{float(r['rel_error_pct']):>+7.1f}" for r in per_tenant]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
