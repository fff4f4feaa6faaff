"""``twinserve validate``: replay one workload through the real engine and through its twin, and
measure how far the twin lands.

    twinserve validate --model DIR --trace NAME|PATH --policy NAME [trace flags] [engine flags] \\
        [--profile PROFILE.json] --out DIR

1. Real: the engine runs in this process in real time. A driver loop adds each trace request when
   its arrival time has come (prompt ``TraceRequest.prompt_token_ids(vocab)``, greedy,
   ``max_tokens`` = its output length, ``ignore_eos``; tenant and priority from the trace), steps
   while work exists and sleeps until the next arrival when idle. Every step is recorded through
   ``gpu.profiler.StepRecorder``: its ``SchedulerOutput`` aggregates, the whole step's seconds and
   the forward pass's (``OUT/real/step_features.csv``: ``calibrate --from-run`` fits on it).
2. Sim: the same trace through ``simulate`` with the calibrated profile and the real engine's
   settings (its KV block count, batch limits, block size, prefix caching, chunked prefill, policy,
   max_model_len).
3. ``OUT/real`` (backend ``twinserve``), ``OUT/sim`` (backend ``sim``), the error table
   ``OUT/errors.csv`` (signed relative error of the twin per metric, with the targets) and
   ``OUT/report.html``. With ``--real-repeats N`` the real replay runs N times (``OUT/real``,
   ``OUT/real-2``, ...; a fresh scheduler and cache each time) and the twin is compared with the
   median of each metric, the spread of the real runs shown beside it: on a shared machine one
   replay's TPOT can move by a fifth. The row ``replayed_step_time_s`` times the real runs' own
   steps with the profile (measured total vs predicted total): when it is off, the
   step-time model (or the machine's speed since calibration) is to blame, not the scheduling.

Without ``--profile`` the backend is calibrated first (quick mode) and the profile saved as
``OUT/profile.json``. ``--reuse-real RUN_DIR [RUN_DIR ...]`` skips the real replay and compares
against real run folders written before (same workload flags): handy to try another profile.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from twinserve.entrypoints.calibrate import (add_calibration_flags, calibrate_backend,
                                             load_runner, model_dir_or_default, save_profile,
                                             set_threads)

# metric, target |relative error| in % (None: reported, no target)
TARGETS: tuple[tuple[str, float | None], ...] = (
    ("request_throughput", 5.0), ("output_throughput", 5.0), ("mean_ttft_ms", 10.0),
    ("p90_ttft_ms", None), ("mean_tpot_ms", 10.0), ("mean_e2el_ms", 5.0),
    ("median_e2el_ms", None), ("p90_e2el_ms", 10.0), ("num_preemptions", None),
    ("prefix_cache_hit_rate", None),
)
STEP_TIME_METRIC = "replayed_step_time_s"  # the real steps, measured vs as the profile times them
ERROR_COLUMNS = ("metric", "real", "sim", "rel_error_pct", "target_pct", "within_target",
                 "real_min", "real_max", "real_runs")


# ---- the real replay -----------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class RealReplay:
    records: list  # RequestRecord
    steps: list  # StepRecord
    measured: list  # gpu.profiler.MeasuredStep, one per StepRecord
    summary: dict[str, Any]
    wall_time_s: float


def replay_real(engine, trace: list, progress: bool = True, detokenize: bool = True) -> RealReplay:
    """Replays ``trace`` (sorted by arrival) through ``engine`` (an ``LLMEngine``) in real time.
    Times in the records are seconds since the replay started (the first arrival is at 0)."""
    from twinserve.core.metrics import RequestRecord, summarize
    from twinserve.core.sampling_params import SamplingParams
    from twinserve.gpu.profiler import StepRecorder
    vocab, block_size = engine.runner.vocab_size, engine.config.block_size
    uses_priority = engine.policy.uses_priority
    pending = deque(sorted(trace, key=lambda r: r.arrival_time))
    requests, failed = [], []
    prompts = {tr.request_id: tr.prompt_token_ids(vocab, block_size) for tr in pending}
    recorder = StepRecorder(engine)
    first_step = len(engine.metrics.steps)
    t_wall = time.perf_counter()
    origin = engine.now()
    done_seen, last_print = 0, 0.0
    try:
        while pending or engine.has_unfinished_requests():
            now = engine.now() - origin
            while pending and pending[0].arrival_time <= now:
                tr = pending.popleft()
                params = SamplingParams(max_tokens=tr.output_tokens, ignore_eos=True,
                                        temperature=0.0)
                try:
                    rid = engine.add_request(
                        prompts.pop(tr.request_id), params, request_id=tr.request_id,
                        arrival_time=origin + tr.arrival_time,
                        priority=tr.priority if uses_priority else 0, tenant=tr.tenant,
                        hints={"output_len_hint": float(tr.output_tokens)}, detokenize=detokenize)
                except ValueError as exc:  # can never run: a failed request, as in the simulator
                    failed.append(_rejected(tr, str(exc)))
                    continue
                requests.append(engine.scheduler.requests[rid])
            if engine.has_unfinished_requests():
                engine.step()
            elif pending:
                time.sleep(max(0.0, pending[0].arrival_time - (engine.now() - origin)))
            if progress and time.perf_counter() - last_print > 10:
                last_print = time.perf_counter()
                done_seen = sum(1 for r in requests if r.is_finished)
                print(f"  real: t={engine.now() - origin:7.1f} s, {done_seen}/{len(trace)} done, "
                      f"{len(engine.scheduler.running)} running, {engine.scheduler.num_waiting} "
                      "waiting", file=sys.stderr, flush=True)
    finally:
        recorder.close()
    records = sorted([RequestRecord.from_request(r, origin) for r in requests] + failed,
                     key=lambda r: r.arrival_time)
    steps = engine.metrics.steps[first_step:]
    if len(steps) != len(recorder.steps):
        raise RuntimeError(f"recorded {len(recorder.steps)} timed steps for {len(steps)} engine "
                           "steps: the step recorder lost track.")
    # the whole engine step's duration (what the simulator's cost model stands for)
    steps = [dataclasses.replace(s, time=s.time - origin, duration=m.seconds)
             for s, m in zip(steps, recorder.steps)]
    duration = max((r.finish_time for r in records if r.success), default=0.0)
    summary = summarize(records, duration_s=duration or None)
    return RealReplay(records, steps, recorder.steps, summary, time.perf_counter() - t_wall)


def _rejected(tr, error: str):
    from twinserve.core.metrics import RequestRecord
    nan = math.nan
    return RequestRecord(tr.request_id, tr.arrival_time, nan, nan, nan, tr.input_tokens, 0,
                         tenant=tr.tenant, priority=tr.priority, finish_reason="", success=False,
                         error=error)


def write_real_run(replay: RealReplay, engine, out_dir: Path, trace_desc: dict[str, Any],
                   model: str, label: str | None = None) -> Path:
    from twinserve.core.run_dir import write_run
    from twinserve.entrypoints.calibrate import to_samples
    from twinserve.simulator.calibration import write_samples
    args = engine.args
    config = {"backend": "twinserve", "label": label or f"real {args.scheduling_policy}",
              **trace_desc, **engine.engine_config.to_dict(),  # what the engine really used
              "model": model, "device": str(engine.runner.device),
              "wall_time_s": replay.wall_time_s}
    write_run(out_dir, config, replay.records, replay.summary, replay.steps)
    write_samples(out_dir / "step_features.csv", to_samples(replay.measured))
    return out_dir


# ---- the twin ------------------------------------------------------------------------------
def simulate_like(real_config: dict[str, Any], model: str, profile: str | Path, trace: list,
                  out_dir: Path, trace_desc: dict[str, Any], log=None):
    """The twin of a real run (``real_config``: its config.json): the real run's resolved
    engine arguments on the profile's device, resolved by the same function. Where the profile
    sizes the KV cache differently from the machine (another memory figure), the real block
    counts are pinned, and ``log`` says so: the comparison is about step times, not memory."""
    from twinserve.core.engine_args import EngineArgs
    from twinserve.simulator import SimConfig, simulate, write_sim_run
    from twinserve.simulator.run import build_engine_config
    given = {k: real_config[k] for k in EngineArgs.field_names()
             if k in real_config and k not in ("model", "device")}
    label = f"sim {real_config['scheduling_policy']}"
    cfg = SimConfig(EngineArgs.from_mapping(given, "the real run's config.json", model=model),
                    hardware=str(profile), label=label)
    resolved = build_engine_config(cfg)[0]
    twin = resolved.scheduler
    real_blocks = (int(real_config["num_gpu_blocks"]), int(real_config.get("num_cpu_blocks", 0)))
    if (twin.num_gpu_blocks, twin.num_cpu_blocks) != real_blocks:
        if log is not None:
            log(f"the profile sizes {twin.num_gpu_blocks} KV blocks ({twin.num_cpu_blocks} host) "
                f"where the real engine had {real_blocks[0]} ({real_blocks[1]}): the twin uses "
                "the real counts")
        swap_space = (real_blocks[1] + 0.5) * resolved.block_bytes / 2**30
        cfg = SimConfig(cfg.engine.replace(num_gpu_blocks_override=real_blocks[0],
                                           swap_space=swap_space),
                        hardware=str(profile), label=label)
    result = simulate(cfg, trace)
    write_sim_run(result, out_dir, {**trace_desc, "profile": str(profile)})
    return result


# ---- the comparison ------------------------------------------------------------------------
def error_rows(reals: list[dict[str, Any]], sim: dict[str, Any]) -> list[dict[str, Any]]:
    """The twin's signed relative error per metric against the median of the real runs."""
    if not reals:
        raise ValueError("error_rows needs at least one real run summary.")
    return [error_row(metric, [_num(r.get(metric)) for r in reals], _num(sim.get(metric)), target)
            for metric, target in TARGETS]


def error_row(metric: str, reals: list[float], sim: float,
              target: float | None = None) -> dict[str, Any]:
    """One metric: the median of the real values against the twin's."""
    values = [v for v in reals if not math.isnan(v)]
    r = float(np.median(values)) if values else math.nan
    if math.isnan(r) or math.isnan(sim):
        err = math.nan
    elif r == 0:
        err = 0.0 if sim == 0 else math.nan
    else:
        err = 100.0 * (sim - r) / r
    within = "" if target is None or math.isnan(err) else str(abs(err) <= target).lower()
    return {"metric": metric, "real": r, "sim": sim, "rel_error_pct": err,
            "target_pct": "" if target is None else target, "within_target": within,
            "real_min": min(values, default=math.nan), "real_max": max(values, default=math.nan),
            "real_runs": len(values)}


def tenant_ttft_rows(real_dirs: list[Path], sim_dir: Path) -> list[dict[str, Any]]:
    """``mean_ttft_ms[<tenant>]`` per tenant when the workload has several: what a fairness
    policy moves while the overall means barely change."""
    reals = [_tenant_mean_ttft(d / "requests.csv") for d in real_dirs]
    sim = _tenant_mean_ttft(sim_dir / "requests.csv")
    if len(sim) < 2:
        return []
    return [error_row(f"mean_ttft_ms[{t}]", [r.get(t, math.nan) for r in reals], sim[t])
            for t in sorted(sim)]


def _tenant_mean_ttft(path: Path) -> dict[str, float]:
    by_tenant: dict[str, list[float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["success"] == "1":
                by_tenant.setdefault(row["tenant"], []).append(float(row["ttft_ms"]))
    return {t: float(np.mean(v)) for t, v in by_tenant.items()}


def step_time_row(real_dirs: list[Path], model: str, profile: str | Path,
                  block_size: int) -> dict[str, Any]:
    """The real runs' own steps timed by the profile: measured total seconds (``real``) against
    the cost model's total for the very same steps (``sim``). It separates the step-time model's
    error (or the machine's drift since calibration) from the scheduling dynamics."""
    from twinserve.core.outputs import SchedulerOutput
    from twinserve.simulator.calibration import AGGREGATE_FIELDS, read_samples
    from twinserve.simulator.cost_model import make_cost_model
    from twinserve.simulator.hardware import load_hardware
    from twinserve.simulator.model_spec import load_model_spec
    samples = []
    for real_dir in real_dirs:
        try:
            samples += read_samples(real_dir)
        except FileNotFoundError:
            continue
    cost = make_cost_model(load_model_spec(model), load_hardware(profile), 1, block_size)
    real = sum(s.seconds for s in samples)
    sim = sum(cost.step_time(SchedulerOutput(**{k: s.aggregates[k] for k in AGGREGATE_FIELDS}))
              for s in samples)
    err = 100.0 * (sim - real) / real if real > 0 else math.nan
    return {"metric": STEP_TIME_METRIC, "real": real if samples else math.nan,
            "sim": sim if samples else math.nan, "rel_error_pct": err, "target_pct": "",
            "within_target": "", "real_min": math.nan, "real_max": math.nan,
            "real_runs": len(real_dirs) if samples else 0}


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def write_errors(path: Path, rows: list[dict[str, Any]]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, ERROR_COLUMNS, lineterminator="\n")
        w.writeheader()
        for row in rows:
            w.writerow({k: (repr(round(v, 6)) if isinstance(v, float) and not math.isnan(v) else
                            ("" if isinstance(v, float) else v)) for k, v in row.items()})
    return path


def format_errors(rows: list[dict[str, Any]], title: str = "sim vs real") -> str:
    spread = any(row.get("real_runs", 1) > 1 for row in rows)
    lines = [title, f"  {'metric':<24} {'real':>12} {'sim':>12} {'error %':>9} {'target':>7}"
             + ("   real min..max" if spread else "")]
    for row in rows:
        target = f"±{row['target_pct']:g}" if row["target_pct"] != "" else ""
        mark = {"true": " ok", "false": " MISS"}.get(row["within_target"], "")
        line = (f"  {row['metric']:<24} {row['real']:>12.4g} {row['sim']:>12.4g} "
                f"{row['rel_error_pct']:>+9.2f} {target:>7}{mark:<5}")
        if spread and row.get("real_runs", 0) > 1:
            line += f" {row['real_min']:.4g}..{row['real_max']:.4g}"
        lines.append(line.rstrip())
    return "\n".join(lines)


# ---- the command ---------------------------------------------------------------------------
def add_parser(sub) -> None:
    from twinserve.entrypoints.engine_args import add_engine_args
    from twinserve.traces import add_trace_args
    p = sub.add_parser("validate", help="replay a trace on the real engine and its twin; errors",
                       description=__doc__.split("\n\n", 1)[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 1)[1])
    add_trace_args(p)
    p.add_argument("--model", default=None, help="HF model directory (default: bundled model)")
    p.add_argument("--profile", default=None,
                   help="calibrated hardware profile (default: calibrate first, quick)")
    p.add_argument("--reuse-real", nargs="+", default=None, metavar="RUN_DIR",
                   help="compare against these real run folders instead of replaying again")
    p.add_argument("--real-repeats", type=_positive_int, default=1, metavar="N",
                   help="replay the real engine N times; compare with the median of each metric")
    p.add_argument("--out", required=True, help="output folder (real/, sim/, errors.csv, ...)")
    p.add_argument("--no-detokenize", dest="detokenize", action="store_false",
                   help="skip incremental detokenization in the real engine")
    p.add_argument("--quiet", action="store_true")
    add_engine_args(p)
    add_calibration_flags(p)
    p.set_defaults(handler=run_validate)


def load_workload(args: argparse.Namespace) -> list:
    from twinserve.traces import trace_from_args
    trace = trace_from_args(args)
    if not trace:
        raise ValueError("the workload flags select no request.")
    return trace


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def real_runs(args: argparse.Namespace, trace: list, desc: dict[str, Any], out: Path,
              model: str, log) -> tuple[list[Path], str | Path]:
    """The real replays (``--real-repeats`` of them) and the profile (calibrated when not given)."""
    from twinserve.gpu.llm_engine import LLMEngine
    set_threads(args.threads)
    eargs, runner = load_runner(args)
    log(f"real engine: {runner.device} {runner.dtype}, {runner.num_gpu_blocks} KV blocks; "
        f"{len(trace)} requests")
    profile = args.profile
    if profile is None:
        from twinserve.simulator.model_spec import load_model_spec
        cal = calibrate_backend(runner, eargs, load_model_spec(model).name, quick=True,
                                warmup=args.warmup, repeats=args.repeats,
                                engine_loop=args.engine_loop, log=log)
        profile = save_profile(cal, model, args.base_hardware, out / "profile.json",
                               eargs.block_size, "Calibrated by validate (quick).")
        log(cal.report)
    dirs = []
    for i in range(args.real_repeats):
        engine = LLMEngine(eargs, runner=runner, usage_context="server")  # fresh scheduler, cache
        replay = replay_real(engine, trace, progress=not args.quiet, detokenize=args.detokenize)
        label = f"real {args.scheduling_policy}" + (f" #{i + 1}" if args.real_repeats > 1 else "")
        dirs.append(write_real_run(replay, engine, out / ("real" if i == 0 else f"real-{i + 1}"),
                                   desc, model, label))
        log(f"real replay {i + 1}/{args.real_repeats}: {replay.wall_time_s:.1f} s wall, "
            f"{len(replay.steps)} steps")
    return dirs, profile


def run_validate(args: argparse.Namespace) -> int:
    from twinserve.reports import write_report
    from twinserve.traces import trace_desc
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.model = model = model_dir_or_default(args.model)
    trace = load_workload(args)
    desc = trace_desc(args)
    log = (lambda msg: None) if args.quiet else (
        lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.reuse_real:
        if args.profile is None:
            raise ValueError("--reuse-real needs --profile (no backend is loaded to calibrate).")
        real_dirs, profile = [Path(d) for d in args.reuse_real], args.profile
    else:
        real_dirs, profile = real_runs(args, trace, desc, out, model, log)
    real_config = json.loads((real_dirs[0] / "config.json").read_text())
    summaries = [json.loads((d / "summary.json").read_text()) for d in real_dirs]
    sim = simulate_like(real_config, model, profile, trace, out / "sim", desc, log)
    rows = error_rows(summaries, sim.summary)
    rows.append(step_time_row(real_dirs, model, profile, int(real_config["block_size"])))
    rows += tenant_ttft_rows(real_dirs, out / "sim")
    write_errors(out / "errors.csv", rows)
    print(format_errors(rows, f"sim vs real ({real_config['scheduling_policy']}, "
                              f"{len(trace)} requests, {len(real_dirs)} real run(s), "
                              f"profile {profile})"))
    try:
        report = write_report([*real_dirs, out / "sim"], out / "report.html",
                              title=f"twinserve validate: {real_config['scheduling_policy']}")
        print(f"report: {report}")
    except Exception as exc:  # the error table is the result; a report failure is not fatal
        print(f"report not written: {exc}", file=sys.stderr)
    return 0
