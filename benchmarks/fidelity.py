"""Fidelity of the twin: the same Azure-conv slice replayed on the real engine and in simulation.

    python -m twinserve.benchmarks.fidelity [--out runs/fidelity] [--num-requests 200] \\
        [--max-model-len 2048] [--max-output-tokens 128] [--time-scale S] [--dtype auto] \\
        [--scenarios fcfs,fair,light,overload] [--real-repeats 3] [--micro]

1. Calibration, out of sample: a real replay of a *different* slice of the trace (requests from
   ``--calib-window``, fcfs, same load), whose recorded steps are fitted by
   ``twinserve calibrate --from-run`` into ``OUT/profile.json``. With ``--micro`` the
   micro-benchmark profile (``twinserve calibrate --quick``) is evaluated as well, against the same
   real runs (``validate --reuse-real``: no second replay).
2. Scenarios, each a ``twinserve validate`` run (prefix caching on, chunked prefill on):
   ``fcfs`` and ``fair`` (tenants heavy=3, light=1) at ``--time-scale`` (near saturation),
   ``light`` at a third of that load, ``overload`` at twice the load with a KV cache cut to
   ``--overload-blocks`` blocks (preemptions).
3. The table of relative errors (sim - real) / real per scenario and metric, with the targets
   (throughput and mean E2EL 5%, mean TTFT, mean TPOT and p90 E2EL 10%): ``OUT/fidelity.csv``.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

from twinserve.entrypoints.cli import main as cli

SCENARIOS = ("fcfs", "fair", "light", "overload")
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
    if name == "fcfs":
        return _workload(args, s) + ["--policy", "fcfs"]
    if name == "fair":
        return _workload(args, s) + ["--policy", "fair", "--tenants", "heavy=3,light=1"]
    if name == "light":
        return _workload(args, s / 3) + ["--policy", "fcfs"]
    if name == "overload":
        return _workload(args, 2 * s) + ["--policy", "fcfs", "--num-gpu-blocks-override",
                                         str(args.overload_blocks)]
    raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")


def _model(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model] if args.model else []


def _repeats(name: str, args: argparse.Namespace) -> int:
    return args.real_repeats if name in TARGET_SCENARIOS else 1


def _real_dirs(folder: Path, repeats: int) -> list[Path]:
    """Where ``validate --real-repeats`` writes its real runs."""
    return [folder / ("real" if i == 0 else f"real-{i + 1}") for i in range(repeats)]


def read_errors(path: Path) -> dict[str, dict[str, str]]:
    with open(path) as f:
        return {row["metric"]: row for row in csv.DictReader(f)}


def _run(argv: list[str]) -> None:
    print("+ twinserve " + " ".join(argv), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    rc = cli(argv)
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
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--time-scale", type=float, default=0.75,
                   help="arrival speed-up of the near-saturation scenarios (tune to the machine: "
                        "where the simulated queue time starts to grow)")
    p.add_argument("--real-repeats", type=int, default=3,
                   help="real replays of each target scenario (fcfs, fair); medians are compared")
    p.add_argument("--overload-blocks", type=int, default=None,
                   help="KV blocks in the overload scenario (default: 4 full-length requests)")
    p.add_argument("--calib-window", default="120:",
                   help="trace seconds the calibration replay takes its requests from")
    p.add_argument("--calib-requests", type=int, default=None,
                   help="requests of the calibration replay (default --num-requests)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--micro", action="store_true",
                   help="also evaluate the micro-benchmark profile (calibrate --quick)")
    p.add_argument("--profile", default=None, help="use this profile, skip the calibration replay")
    p.add_argument("--no-loo", dest="loo", action="store_false",
                   help="skip the leave-one-out profiles (fitted on the other scenarios' runs)")
    p.add_argument("--no-self", dest="self_fit", action="store_false",
                   help="skip the in-sample profiles (fitted on the scenario's own run)")
    p.add_argument("--resume", action="store_true",
                   help="reuse real runs already in OUT (re-simulate only)")
    args = p.parse_args(argv)
    if args.overload_blocks is None:
        args.overload_blocks = 4 * -(-args.max_model_len // 16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    for n in names:
        scenario_flags(n, args)  # unknown names fail before anything runs
    t_start = time.perf_counter()
    backend = _engine_flags(args)  # what calibrate takes
    engine = backend + ["--enable-prefix-caching", "--enable-chunked-prefill"]
    profiles: dict[str, str] = {}
    if args.profile:
        profiles["given"] = args.profile
    else:
        calib = argparse.Namespace(**{**vars(args), "num_requests": args.calib_requests
                                      or args.num_requests})
        if not (out / "calib" / "real" / "step_features.csv").is_file():  # else: reused
            _run(["validate", *_workload(calib, args.time_scale, args.calib_window), "--policy",
                  "fcfs", *engine, "--profile", "cpu", "--out", str(out / "calib"), "--quiet"])
        _run(["calibrate", "--from-run", str(out / "calib" / "real"), "--out",
              str(out / "profile.json"), *_model(args)])
        profiles["from-run"] = str(out / "profile.json")
    if args.micro and args.resume and (out / "profile-micro.json").is_file():
        profiles["micro"] = str(out / "profile-micro.json")
    elif args.micro:
        _run(["calibrate", "--quick", *backend, "--out", str(out / "profile-micro.json"),
              "--samples-out", str(out / "profile-micro-samples.csv")])
        profiles["micro"] = str(out / "profile-micro.json")
    first_label = next(iter(profiles))
    real = {name: _real_dirs(out / f"{name}-{first_label}", _repeats(name, args)) for name in names}
    rows = []
    for name in names:  # the real replays (each compared with the first profile)
        argv = ["validate", *scenario_flags(name, args), *engine, "--profile",
                profiles[first_label], "--out", str(out / f"{name}-{first_label}"), "--quiet"]
        if args.resume and all((d / "step_features.csv").is_file() for d in real[name]):
            argv += ["--reuse-real", *map(str, real[name])]  # re-simulate only
        else:
            argv += ["--real-repeats", str(_repeats(name, args))]
        _run(argv)
    if args.loo and len(names) > 1:  # leave one out: fitted on every other real run
        for name in names:
            path = out / f"profile-loo-{name}.json"
            others = [str(d) for n in names if n != name for d in real[n]]
            if (out / "calib" / "real").is_dir():
                others.append(str(out / "calib" / "real"))
            _run(["calibrate", "--from-run", *others, "--out", str(path), *_model(args)])
    if args.self_fit:  # in sample: the fit of the run itself (the twin's floor of error)
        for name in names:
            _run(["calibrate", "--from-run", *map(str, real[name]), "--out",
                  str(out / f"profile-self-{name}.json"), *_model(args)])
    for name in names:
        scenario_profiles = dict(profiles)
        if args.loo and len(names) > 1:
            scenario_profiles["loo"] = str(out / f"profile-loo-{name}.json")
        if args.self_fit:
            scenario_profiles["self"] = str(out / f"profile-self-{name}.json")
        for label, profile in scenario_profiles.items():
            folder = out / f"{name}-{label}"
            if label != first_label:
                _run(["validate", *scenario_flags(name, args), *engine, "--profile", profile,
                      "--out", str(folder), "--quiet", "--reuse-real", *map(str, real[name])])
            for metric, row in read_errors(folder / "errors.csv").items():
                rows.append({"scenario": name, "profile": label, **row})
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
    return {"request_throughput": "req/s", "num_preemptions": "preempt",
            "prefix_cache_hit_rate": "cache_hit", "replayed_step_time_s": "steps"}.get(metric, metric.removesuffix("_ms"))


def format_table(rows: list[dict[str, str]]) -> str:
    """One line per scenario and profile: the signed error (%) of each metric; * marks a miss."""
    head = f"{'scenario':<10} {'profile':<9}" + "".join(f" {_short(m):>10}" for m in SHOWN)
    lines = ["sim vs real, relative error % (* = outside target)", head]
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
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
