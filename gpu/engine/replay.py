"""A trace replayed through the real engine in real time, and the run folder it leaves.

A driver loop adds each trace request when its arrival time has come (prompt
``TraceRequest.prompt_token_ids(vocab)``, greedy, ``max_tokens`` = its output length,
``ignore_eos``; tenant and priority from the trace), steps while work exists and sleeps until the
next arrival when idle. Every step is recorded through ``gpu.engine_loop.StepRecorder``: its
``SchedulerOutput`` aggregates, the whole step's seconds and the forward pass's
(``RUN/step_features.csv``: ``calibrate --from-run`` fits on it); with speculation, each
request's drafts step by step (``RUN/drafts.csv``, ``core.draft_record``). ``twinserve validate``
sets the twin beside it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from twinserve.core.draft_record import DRAFTS_FILE, DraftRecorder, DraftStep, write_drafts
from twinserve.core.errors import EngineOverloaded
from twinserve.core.kv_offload import OffloadingStats
from twinserve.core.metrics import RequestRecord, StepRecord, kv_offload_summary, summarize
from twinserve.core.request import Request
from twinserve.core.run_dir import write_run
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.step_sample import SAMPLES_FILE, StepSample, write_samples
from twinserve.gpu.engine.engine_loop import StepRecorder
from twinserve.gpu.engine.llm_engine import LLMEngine
from twinserve.traces import TraceRequest

PROGRESS_EVERY_S = 10.0


@dataclasses.dataclass(slots=True)
class RealReplay:
    records: list[RequestRecord]
    steps: list[StepRecord]
    measured: list[StepSample]  # one per StepRecord
    summary: dict[str, Any]
    wall_time_s: float
    drafts: list[DraftStep] = dataclasses.field(default_factory=list)  # with speculation


def replay_real(engine: LLMEngine, trace: Iterable[TraceRequest], progress: bool = True,
                detokenize: bool = True) -> RealReplay:
    """Replays ``trace`` (sorted by arrival) through ``engine`` in real time. Times in the records
    are seconds since the replay started (the first arrival is at 0)."""
    vocab, block_size = engine.runner.vocab_size, engine.config.block_size
    uses_priority = engine.policy.uses_priority
    pending = deque(sorted(trace, key=lambda r: r.arrival_time))
    with_adapter = next((tr for tr in pending if tr.lora is not None), None)
    if with_adapter is not None:  # a name is not an adapter: the real engine needs its weights
        raise ValueError(f"request {with_adapter.request_id!r} of the trace names LoRA adapter "
                         f"{with_adapter.lora!r}: replaying adapters on the real engine is not "
                         "implemented (the twin simulates them: twinserve simulate --enable-lora).")
    total = len(pending)
    requests: list[Request] = []
    failed: list[RequestRecord] = []
    prompts = {tr.request_id: tr.prompt_token_ids(vocab, block_size) for tr in pending}
    recorder = StepRecorder(engine)
    drafts = DraftRecorder() if engine.scheduler.speculation is not None else None
    if drafts is not None:
        engine.driver.observers.append(drafts)
    first_step = len(engine.metrics.steps)
    t_wall = time.perf_counter()
    origin = engine.now()
    last_print = 0.0
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
                except (ValueError, EngineOverloaded) as exc:  # never (400) or not now (503):
                    # a failed request, as in the simulator
                    failed.append(rejected_record(tr, str(exc)))
                    continue
                requests.append(engine.scheduler.requests[rid])
            if engine.has_unfinished_requests():
                engine.step()
            elif pending:
                time.sleep(max(0.0, pending[0].arrival_time - (engine.now() - origin)))
            if progress and time.perf_counter() - last_print > PROGRESS_EVERY_S:
                last_print = time.perf_counter()
                done = sum(1 for r in requests if r.is_finished)
                print(f"  real: t={engine.now() - origin:7.1f} s, {done}/{total} done, "
                      f"{len(engine.scheduler.running)} running, {engine.scheduler.num_waiting} "
                      "waiting", file=sys.stderr, flush=True)
    finally:
        recorder.close()
        if drafts is not None:
            engine.driver.observers.remove(drafts)
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
    tier = getattr(engine.scheduler.connector, "stats", None)
    if isinstance(tier, OffloadingStats):  # the host tier's counts (since the engine started)
        summary.update(kv_offload_summary([tier]))
    return RealReplay(records, steps, recorder.steps, summary, time.perf_counter() - t_wall,
                      drafts.steps if drafts is not None else [])


def rejected_record(tr: TraceRequest, error: str) -> RequestRecord:
    """The record of a trace request the engine refused (it can never run)."""
    nan = math.nan
    return RequestRecord(tr.request_id, tr.arrival_time, nan, nan, nan, tr.input_tokens, 0,
                         tenant=tr.tenant, priority=tr.priority, lora=tr.lora or "",
                         finish_reason="", success=False, error=error)


def write_real_run(replay: RealReplay, engine: LLMEngine, out_dir: Path,
                   trace_desc: dict[str, Any], model: str, label: str | None = None) -> Path:
    """The run folder of a replay (backend ``twinserve``, the engine's resolved configuration)
    with its step samples (``step_features.csv``)."""
    args = engine.args
    config = {"backend": "twinserve", "label": label or f"real {args.scheduling_policy}",
              **trace_desc, **engine.engine_config.to_dict(),  # what the engine really used
              "model": model, "device": str(engine.runner.device),
              "wall_time_s": replay.wall_time_s}
    write_run(out_dir, config, replay.records, replay.summary, replay.steps)
    write_samples(out_dir / SAMPLES_FILE, replay.measured)
    if replay.drafts:
        write_drafts(out_dir / DRAFTS_FILE, replay.drafts)
    return out_dir
