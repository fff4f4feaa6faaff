"""``twinserve validate --prefill-instances X --decode-instances Y --profile P``: one workload
through the real disaggregated deployment and through the twin's xPyD fleet.

Real: the P/D front (``entrypoints/pd_front.py``, the deployment ``serve`` and
``LLM(prefill_instances=, decode_instances=)`` start) in real time; each trace request is
submitted when its arrival time comes (greedy, ``max_tokens`` = its output length,
``ignore_eos``). Four requests go first, unrecorded, so that each of the decode instance's load
threads has connected to its producer and mapped its region once, as a server's long have.

Timing is the front's, on ``time.monotonic()`` (one clock for every process of the machine):
TTFT runs from the request's submission at the front to the first token the front sees, so it
holds the prefill instance's queue and prefill, the hand-off and the KV load, the decode
instance's first step and the hops between processes. Its parts, as the twin writes them
(``core.run_dir.PD_REQUEST_COLUMNS``): ``ttft_queue_s`` to the prefill's first step (the
prefill instance's record), ``ttft_prefill_s`` to its output there, ``ttft_transfer_s`` to the
end of the decode instance's load (the hand-off through the front, the wait for the decode
instance's next step, the copy), ``ttft_decode_s`` to the first token at the front (the decode
instance noticing the load, its queue, the step that samples, the hop back).
``kv_transfer_s``/``kv_transfer_bytes``: the load itself (its background thread's start and end,
the bytes copied: ``RequestOutput.kv_load``). TPOT and ITLs are the gaps the front sees.

Twin: ``simulate --prefill-instances X --decode-instances Y`` on the profile, with the real
instances' resolved settings (``simulator.twin_of_run``) and ``--kv-link`` (default: the
profile's measured ``kv_link``; a CPU profile without one gets this machine's Peer connector
measured now, ``gpu.measurement.kv_transfer``, saved as ``OUT/profile.json``).

Writes ``OUT/real`` (backend ``twinserve``; each instance's steps in ``steps.csv``, their
replica column the instance's index, prefill instances first, as the twin's, and their measured
samples in ``step_features.csv``, whose time against the profile's is the row
``replay_speed_vs_profile``; ``--at-replay-speed`` runs the twin on the profile scaled to it,
``OUT/profile-at-replay-speed.json``),
``OUT/sim``, ``OUT/errors.csv`` (``reports.fidelity``'s rows plus the transfer and TTFT-part
means) and prints the table. ``--real-repeats N`` runs the real deployment N times, each a
fresh one (``OUT/real``, ``OUT/real-2``, ...: ``fidelity.replays.run_dir_name``), and judges
the twin against each metric's median, as single-engine validate does (``reports.fidelity``,
``reports.repeatability`` from three runs on). Under the table, each run's KV loads split by
whether the decode instance was inside a step meanwhile (``load_split``): on a CPU the two
differ by about 2x, which the twin's ``consumer_step_share`` models.
"""

from __future__ import annotations

import argparse
import math
import queue
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

from twinserve.core.engine_args import EngineArgs
from twinserve.core.errors import EngineOverloaded
from twinserve.core.kv_transfer_config import KVTransferConfig
from twinserve.core.metrics import RequestRecord, StepRecord, summarize
from twinserve.core.request_output import KVLoadTiming
from twinserve.core.run_dir import DisaggregatedParts, write_run
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.step_sample import SAMPLES_FILE, StepSample, write_samples
from twinserve.entrypoints.cli.validate_refusals import refuse_fleet_flags
from twinserve.entrypoints.pd_front import DisaggregatedFront, InstanceRecord, PDDeployment
from twinserve.fidelity.comparison import ErrorTable
from twinserve.fidelity.workload import Workload
from twinserve.traces import TraceRequest

Log = Callable[[str], None]
FINISH_TIMEOUT_S = 600.0
WARMUP_REQUESTS = 4  # the consumer's load threads (peer_connector.MAX_CONCURRENT_LOADS)
TTFT_PARTS = ("queue", "prefill", "transfer", "decode")
# beside reports.fidelity's rows: the P/D summary keys both runs write (no targets)
PD_METRICS = ("mean_kv_transfer_ms", "p90_kv_transfer_ms",
              *(f"mean_ttft_{p}_ms" for p in TTFT_PARTS))


def check_pd_validate(args: argparse.Namespace, engine: EngineArgs) -> None:
    """Refuses, by name, what a P/D validate does not run."""
    refuse_fleet_flags(args, "--prefill-instances")
    if engine.data_parallel_size > 1:
        raise ValueError("--data-parallel-size with --prefill-instances: the pools are the "
                         "replicas; give one or the other.")
    for name, on in (("--enable-lora", engine.enable_lora),
                     ("--speculative-config", engine.speculation is not None),
                     ("--tensor-parallel-size > 1", engine.tensor_parallel_size > 1),
                     ("--pipeline-parallel-size > 1", engine.pipeline_parallel_size > 1)):
        if on:
            raise ValueError(f"{name} is not supported with --prefill-instances.")
    if not getattr(args, "profile", None):
        raise ValueError("validate --prefill-instances needs --profile (a profile calibrated "
                         "with one thread, as each instance runs on its share of the cores).")


# ---- the real deployment ---------------------------------------------------------------
@dataclass(slots=True)
class FrontTiming:
    """One request as the front sees it (the front's reader thread calls ``put``); times on
    ``time.monotonic()``. ``done`` gets the request id when it ends."""

    request_id: str
    submitted: float
    done: queue.SimpleQueue
    token_times: list[float] = field(default_factory=list)  # when each token reached the front
    finished: float = math.nan
    finish_reason: str = ""
    error: str = ""
    kv_load: KVLoadTiming | None = None

    def put(self, item: Any) -> None:
        now = time.monotonic()
        if item is None:  # accepted
            return
        if isinstance(item, BaseException):
            self.fail(f"{type(item).__name__}: {item}", now)
            return
        new = len(item.outputs[0].token_ids) - len(self.token_times)
        self.token_times.extend([now] * new)
        if item.kv_load is not None:
            self.kv_load = item.kv_load
        if item.finished:
            self.finish_reason = item.outputs[0].finish_reason or ""
            self.error = item.error or ""
            self.finished = now
            self.done.put(self.request_id)

    def fail(self, error: str, now: float) -> None:
        self.error, self.finished = error, now
        self.done.put(self.request_id)


@dataclass(slots=True)
class PDReplay:
    """A real P/D replay: the front's view of each request, each instance's records, the
    instances' resolved configurations, ``t0`` (the trace's time 0 on ``time.monotonic()``),
    the instances' steps."""

    timings: list[FrontTiming]
    instance_records: list[InstanceRecord]
    instance_configs: list[dict[str, Any]]
    t0: float
    wall_time_s: float
    # each instance's steps (their rows naming the instance, on the trace's clock) by start
    steps: list[tuple[StepRecord, StepSample]] = field(default_factory=list)


def replay_pd(engine: EngineArgs, pd: PDDeployment, trace: list[TraceRequest],
              vocab_size: int) -> PDReplay:
    """The trace through the real X + Y instances behind the P/D front, in real time."""
    trace = sorted(trace, key=lambda r: r.arrival_time)
    prompts = {tr.request_id: tr.prompt_token_ids(vocab_size, engine.block_size) for tr in trace}
    from twinserve.entrypoints.dp_llm_engine import on_cuda
    front = DisaggregatedFront(engine, pd, "server", on_cuda(engine), record_instances=True)
    try:
        _warm_up(front, vocab_size)
        front.take_instance_records()
        front.take_steps()
        done: queue.SimpleQueue = queue.SimpleQueue()
        timings, records = [], []
        steps: list[tuple[StepRecord, StepSample]] = []
        t0 = time.monotonic()
        for tr in trace:
            records += front.take_instance_records()  # (the front keeps a bounded number)
            steps += front.take_steps()
            time.sleep(max(0.0, t0 + tr.arrival_time - time.monotonic()))
            params = SamplingParams(temperature=0, max_tokens=tr.output_tokens, ignore_eos=True)
            timing = FrontTiming(tr.request_id, time.monotonic(), done)
            timings.append(timing)
            try:
                front.submit(tr.request_id, prompts.pop(tr.request_id), params,
                             {"tenant": tr.tenant}, timing)
            except (ValueError, EngineOverloaded) as exc:  # a failed request, as in the twin
                timing.fail(str(exc), time.monotonic())
        _wait(done, len(timings))
        wall = time.monotonic() - t0
        records += front.take_instance_records()
        steps += front.take_steps()
        for row, _ in steps:  # (from the front's clock to the trace's)
            row.time += front.time_origin - t0
        steps.sort(key=lambda step: (step[0].time, step[0].replica))
        return PDReplay(timings, records, list(front.instance_configs), t0, wall, steps)
    finally:
        front.shutdown()


def _wait(done: queue.SimpleQueue, n: int) -> None:
    """Until ``n`` requests ended (RuntimeError after FINISH_TIMEOUT_S without one ending)."""
    for k in range(n):
        try:
            done.get(timeout=FINISH_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"{n - k} of {n} real requests did not end within "
                               f"{FINISH_TIMEOUT_S:.0f} s.") from None


def _warm_up(front: DisaggregatedFront, vocab_size: int) -> None:
    done: queue.SimpleQueue = queue.SimpleQueue()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(WARMUP_REQUESTS):
        prompt = [(7919 * i + 31 * k) % (vocab_size - 16) + 16 for k in range(48)]
        front.submit(f"warmup-{i}", prompt, params, {}, FrontTiming(f"warmup-{i}", 0.0, done))
    _wait(done, WARMUP_REQUESTS)


def real_results(replay: PDReplay, trace: list[TraceRequest], pd: PDDeployment,
                 ) -> tuple[list[RequestRecord], dict[str, DisaggregatedParts]]:
    """Each request's record on the front's clock (seconds from the trace's start) and its P/D
    parts (``DisaggregatedParts``, the twin's columns)."""
    x, t0 = pd.prefill_instances, replay.t0
    prefill: dict[str, InstanceRecord] = {}
    decode: dict[str, InstanceRecord] = {}
    for rec in replay.instance_records:
        (prefill if rec.instance < x else decode)[rec.record.request_id] = rec
    by_id = {tr.request_id: tr for tr in trace}
    records, parts = [], {}
    for timing in replay.timings:
        tr = by_id[timing.request_id]
        pre, dec = prefill.get(tr.request_id), decode.get(tr.request_id)
        part = DisaggregatedParts("" if pre is None else f"prefill-{pre.instance}",
                                  "" if dec is None else f"decode-{dec.instance - x}",
                                  arrival=timing.submitted - t0)
        if pre is not None:
            part.prefill_start = pre.record.first_scheduled_time - t0
            part.prefill_done = pre.record.finish_time - t0
        load = timing.kv_load
        # (a load that copied nothing, the decode instance's cache holding the prompt, is no
        # transfer: the twin leaves its load times empty too)
        if load is not None and load.ok and load.num_bytes > 0:
            part.load_start, part.load_end = load.start - t0, load.end - t0
            part.kv_transfer_bytes = load.num_bytes
        parts[tr.request_id] = part
        records.append(_front_record(timing, tr, pre, dec, t0))
    return records, parts


def _front_record(timing: FrontTiming, tr: TraceRequest, pre: InstanceRecord | None,
                  dec: InstanceRecord | None, t0: float) -> RequestRecord:
    times = timing.token_times
    ok = not timing.error and timing.finish_reason in ("stop", "length") and bool(times)
    nan = math.nan
    # first_scheduled_time: the decode instance's, as the twin's records are the decode side's
    return RequestRecord(
        tr.request_id, timing.submitted - t0,
        dec.record.first_scheduled_time - t0 if dec is not None else nan,
        times[0] - t0 if times else nan, timing.finished - t0, tr.input_tokens, len(times),
        cached_tokens=dec.record.cached_tokens if dec is not None else 0,
        num_preemptions=sum(r.record.num_preemptions for r in (pre, dec) if r is not None),
        tenant=tr.tenant, priority=tr.priority, finish_reason=timing.finish_reason,
        success=ok, error=timing.error, itls=array("d", np.diff(times)))


def pd_summary(records: list[RequestRecord], parts: dict[str, DisaggregatedParts],
               pd: PDDeployment) -> dict[str, Any]:
    """``summarize`` plus the P/D keys the twin's summary has that a real run can measure
    (the transfers and the TTFT parts, in ms; no pool utilisation)."""
    ok = [r for r in records if r.success]
    summary: dict[str, Any] = summarize(
        records, duration_s=max((r.finish_time for r in ok), default=0.0) or None)
    summary.update(prefill_instances=pd.prefill_instances, decode_instances=pd.decode_instances)
    loads = [p for p in parts.values() if not math.isnan(p.load_end)]
    times = sorted((p.load_end - p.load_start) * 1e3 for p in loads)
    summary["num_kv_transfers"] = len(times)
    summary["kv_transfer_bytes"] = int(sum(p.kv_transfer_bytes for p in loads))
    summary["mean_kv_transfer_ms"] = statistics.fmean(times) if times else 0.0
    summary["p90_kv_transfer_ms"] = float(np.percentile(times, 90)) if times else 0.0
    rows = [parts[r.request_id].row(r.first_token_time) for r in ok]
    for k, name in enumerate(TTFT_PARTS):
        values = [row[4 + k] * 1e3 for row in rows]
        summary[f"mean_ttft_{name}_ms"] = statistics.fmean(values) if values else 0.0
    return summary


def write_real(replay: PDReplay, trace: list[TraceRequest], pd: PDDeployment, out: Path,
               engine: EngineArgs, trace_desc: dict[str, Any]) -> Path:
    """``out`` as a run folder (backend ``twinserve``, the prefill instance's resolved
    configuration, the P/D keys)."""
    records, parts = real_results(replay, trace, pd)
    records.sort(key=lambda r: (r.arrival_time, r.request_id))
    config = {**replay.instance_configs[0]}
    config.pop("kv_transfer_config", None)  # (the prefill instance's role and port)
    if isinstance(engine.kv_transfer_config, KVTransferConfig):  # (the given one, resolved)
        config["kv_transfer_config"] = engine.kv_transfer_config.to_dict()
    config.update({"backend": "twinserve", **trace_desc, "model": str(engine.model),
                   "label": f"real {config.get('scheduling_policy', '')} "
                            f"{pd.prefill_instances}P{pd.decode_instances}D",
                   "prefill_instances": pd.prefill_instances,
                   "decode_instances": pd.decode_instances, "wall_time_s": replay.wall_time_s})
    folder = write_run(out, config, records, pd_summary(records, parts, pd),
                       [row for row, _ in replay.steps], parts)
    write_samples(out / SAMPLES_FILE, [sample for _, sample in replay.steps])
    return folder


# ---- the twin and the comparison -------------------------------------------------------
def twin_link(profile: str, kv_link: str | None, model: str, config: dict[str, Any], out: Path,
              log: Log) -> tuple[str, str | None]:
    """The profile the twin runs on and its ``kv_link``: as given; else the profile's measured
    link; else, for a run on a CPU, this machine's Peer connector measured now and saved with
    the profile as ``out/profile.json``."""
    from twinserve.simulator.hardware import load_hardware
    hardware = load_hardware(profile)
    if hardware.kv_link is not None or kv_link not in (None, "measured"):
        return profile, kv_link
    if config.get("device_type") != "cpu":
        if kv_link == "measured":
            raise ValueError(f"--kv-link measured: profile {profile} has no kv_link, and the "
                             "connector is measured here on a CPU only (cuda_check.sh "
                             "measures CUDA IPC); give a preset.")
        return profile, None
    import dataclasses

    from twinserve.gpu.measurement.kv_transfer import measure_link
    fit, _ = measure_link(kv_layout(model, config))
    log(f"profile {profile} has no kv_link: measured this machine's Peer connector, "
        f"{fit.describe()}")
    with_link = dataclasses.replace(hardware, kv_link=fit.to_kv_link())
    return str(with_link.save(out / "profile.json")), "measured"


def kv_layout(model: str, config: dict[str, Any]) -> Any:
    """The instances' KV layout (``gpu.kv_transfer.region.KVLayout``) for measuring the link,
    from the model and the resolved configuration."""
    from twinserve.core.model_config import ModelConfig
    from twinserve.fidelity.calibration import KV_LINK_BLOCKS
    from twinserve.gpu.kv_transfer.region import KVLayout
    from twinserve.gpu.models.default_model import resolve_model_source
    mc = ModelConfig.from_dir(resolve_model_source(model)[0])
    dtype = config["kv_cache_dtype"] if config.get("kv_cache_dtype", "auto") != "auto" \
        else config["dtype"]
    return KVLayout(mc.num_hidden_layers, int(config["block_size"]), mc.num_key_value_heads,
                    mc.head_dim, str(dtype), KV_LINK_BLOCKS)


def simulate_pd(real_dir: Path, profile: str, trace: list[TraceRequest], pd: PDDeployment,
                kv_link: str | None, out: Path, trace_desc: dict[str, Any], model: str,
                log: Log) -> dict[str, Any]:
    """The twin of the real run in ``real_dir`` as an xPyD fleet; writes ``out``, returns its
    summary."""
    import json

    from twinserve.simulator.run import simulate, write_sim_run
    from twinserve.simulator.twin_of_run import twin_config
    config = json.loads((real_dir / "config.json").read_text())
    one = twin_config(config, model, profile, log)
    cfg = one.replace(prefill_instances=pd.prefill_instances,
                      decode_instances=pd.decode_instances, kv_link=kv_link,
                      label=f"{one.label} {pd.prefill_instances}P{pd.decode_instances}D")
    result = simulate(cfg, trace)
    write_sim_run(result, out, {**trace_desc, "profile": str(profile)})
    return result.summary


def error_table(reals: list[dict[str, Any]], sim: dict[str, Any], title: str,
                speeds: list[float] | None = None) -> ErrorTable:
    """``reports.fidelity``'s rows and the P/D ones (transfers, TTFT parts), the median of the
    real runs beside the twin; ``speeds``: each real run's steps' measured time over the
    profile's (``replay_speed_vs_profile``); the leave-one-out repeatability from three runs
    on."""
    from twinserve.fidelity.speeds import REPLAY_SPEED_METRIC
    from twinserve.reports.fidelity import as_number, error_row, error_rows
    from twinserve.reports.repeatability import repeatability
    rows = error_rows(reals, sim) + [
        error_row(m, [as_number(r.get(m)) for r in reals], as_number(sim.get(m)))
        for m in PD_METRICS]
    if speeds:
        rows.append(error_row(REPLAY_SPEED_METRIC, speeds, 1.0))
    return ErrorTable(tuple(rows), tuple(repeatability(reals, sim)), title)


@dataclass(slots=True, frozen=True)
class LoadSplit:
    """A run's KV loads (mean ms, count) with their decode instance idle or inside a step for
    at least half of the load."""

    idle_ms: float
    idle: int
    in_step_ms: float
    in_step: int

    def format(self) -> str:
        return (f"{self.idle_ms:.1f} ms idle ({self.idle}), {self.in_step_ms:.1f} ms inside "
                f"steps ({self.in_step})")


def load_split(folder: Path) -> LoadSplit:
    """The loads of the run in ``folder`` (its ``requests.csv``), split by the decode instance's
    steps, read from the times of its tokens (first token, then the ITLs) the same way for a
    real run and the twin's: a gap between two consecutive tokens on one instance shorter than
    twice the median gap being one step (longer: idle between them)."""
    import csv
    with open(folder / "requests.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["success"] == "1" and r["kv_transfer_s"]]
    tokens: dict[str, list[float]] = {}
    loads: list[tuple[str, float, float]] = []
    for r in rows:
        times = list(accumulate((float(x) / 1e3 for x in r["itls_ms"].split()),
                                initial=float(r["first_token_time"])))
        tokens.setdefault(r["decode_engine"], []).extend(times)
        end = float(r["arrival_time"]) + sum(float(r[f"ttft_{p}_s"]) for p in TTFT_PARTS[:3])
        loads.append((r["decode_engine"], end - float(r["kv_transfer_s"]), end))
    steps = {engine: _steps(sorted(ts)) for engine, ts in tokens.items()}
    idle, busy = [], []
    for engine, start, end in loads:
        inside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in steps[engine])
        (busy if end > start and inside >= 0.5 * (end - start) else idle).append(end - start)
    return LoadSplit(statistics.fmean(idle) * 1e3 if idle else math.nan, len(idle),
                     statistics.fmean(busy) * 1e3 if busy else math.nan, len(busy))


def _steps(times: list[float]) -> list[tuple[float, float]]:
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    if not gaps:
        return []
    limit = 2 * statistics.median(gaps)
    return [(a, b) for a, b in zip(times, times[1:]) if 0 < b - a < limit]


def run_validate_pd(args: argparse.Namespace, engine: EngineArgs, workload: Workload,
                    pd: PDDeployment) -> int:
    """The real P/D deployment (``--real-repeats`` times) and its twin on ``workload``; prints
    the error table and the loads' split."""
    import json

    from twinserve.core.model_config import ModelConfig
    from twinserve.core.step_sample import read_recorded_samples
    from twinserve.fidelity.speeds import profile_fit, replay_speeds
    from twinserve.fidelity.validation import scaled_profile
    from twinserve.gpu.models.default_model import resolve_model_source
    check_pd_validate(args, engine)
    trace = sorted(workload.requests, key=lambda r: r.arrival_time)
    with_adapter = next((tr for tr in trace if tr.lora is not None), None)
    if with_adapter is not None:
        raise ValueError(f"request {with_adapter.request_id!r} names LoRA adapter "
                         f"{with_adapter.lora!r}: not supported with --prefill-instances.")
    model = str(engine.model)
    log: Log = (lambda msg: None) if getattr(args, "quiet", False) else print
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = ModelConfig.from_dir(resolve_model_source(model)[0]).vocab_size
    real_dirs = real_runs(engine, pd, trace, vocab, out, dict(workload.desc),
                          int(getattr(args, "real_repeats", 1) or 1), log)
    config = json.loads((real_dirs[0] / "config.json").read_text())
    profile, link = twin_link(str(args.profile), getattr(args, "kv_link", None), model, config,
                              out, log)
    speeds = replay_speeds([read_recorded_samples([d]) for d in real_dirs],
                           profile_fit(profile, model))
    if getattr(args, "at_replay_speed", False):  # (the single engine's scaling)
        profile = str(scaled_profile(Path(profile), real_dirs, model, "replay", out, log))
    sim = simulate_pd(real_dirs[0], profile, trace, pd, link, out / "sim", dict(workload.desc),
                      model, log)
    reals = [json.loads((d / "summary.json").read_text()) for d in real_dirs]
    table = error_table(reals, sim, f"sim vs real ({pd.prefill_instances}P"
                                    f"{pd.decode_instances}D, {len(trace)} requests, "
                                    f"{len(real_dirs)} real run(s), profile {profile}, kv link "
                                    f"{sim.get('kv_link')})", speeds)
    table.write(out)
    print(table.format())
    for folder in (*real_dirs, out / "sim"):
        print(f"  KV loads, {folder.name}: {load_split(folder).format()}")
    try:
        from twinserve.reports import write_report
        print(f"report: {write_report([*real_dirs, out / 'sim'], out / 'report.html', title=table.title)}")
    except Exception as exc:  # noqa: BLE001 (the error table is the result, not the report)
        print(f"report not written: {exc}", file=sys.stderr)
    return 0


def real_runs(engine: EngineArgs, pd: PDDeployment, trace: list[TraceRequest], vocab_size: int,
              out: Path, desc: dict[str, Any], repeats: int, log: Log) -> list[Path]:
    """``repeats`` real replays, each on a fresh deployment, as run folders under ``out``."""
    from twinserve.fidelity.replays import run_dir_name
    if repeats < 1:
        raise ValueError(f"--real-repeats must be >= 1, got {repeats}.")
    dirs = []
    for i in range(repeats):
        log(f"real: {pd.prefill_instances}P{pd.decode_instances}D, {len(trace)} requests "
            f"(run {i + 1} of {repeats})")
        replay = replay_pd(engine, pd, trace, vocab_size)
        dirs.append(write_real(replay, trace, pd, out / run_dir_name(i), engine, desc))
    return dirs
