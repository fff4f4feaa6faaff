"""Replaying a workload on the real engine, each replay a run folder with its step samples."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from twinserve.fidelity.acceptance import record_acceptance
from twinserve.fidelity.backend import Log, with_model
from twinserve.fidelity.speeds import SPEED_PROBE_FILE, write_speed_probe
from twinserve.fidelity.workload import Workload

if TYPE_CHECKING:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.worker.model_runner import ModelRunner

Probe = Callable[[], dict[str, float]]


def run_dir_name(index: int) -> str:
    """The folder of replay ``index`` (from 0): ``real``, ``real-2``, ``real-3``, ..."""
    return "real" if index == 0 else f"real-{index + 1}"


def replay(engine: EngineArgs, workload: Workload, out: str | Path, repeats: int = 1,
           runner: ModelRunner | None = None, before_each: Probe | None = None,
           log: Log | None = None, progress: bool = False,
           detokenize: bool = True) -> list[Path]:
    """Replays ``workload`` ``repeats`` times in real time (a fresh scheduler and KV cache each
    time) on ``runner`` (loaded for ``engine`` when ``None``), each into ``out/real``,
    ``out/real-2``, ...; ``before_each`` runs before each replay and returns the host-speed probe
    it starts from (default: the probe alone). Each run folder holds ``speed_probe.json``."""
    from twinserve.fidelity.backend import load_runner
    from twinserve.gpu.engine.llm_engine import LLMEngine
    from twinserve.gpu.engine.replay import replay_real, write_real_run
    from twinserve.gpu.measurement.profiler import speed_probe
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    engine = with_model(engine)
    runner = runner or load_runner(engine)
    probe = before_each or (lambda: speed_probe(runner))
    log = log or (lambda msg: None)
    out = Path(out)
    dirs = []
    for i in range(repeats):
        before = probe()
        llm = LLMEngine(engine, runner=runner, usage_context="server")  # fresh scheduler, cache
        run = replay_real(llm, workload.requests, progress=progress, detokenize=detokenize)
        label = f"real {engine.scheduling_policy}" + (f" #{i + 1}" if repeats > 1 else "")
        dirs.append(write_real_run(run, llm, out / run_dir_name(i), workload.desc,
                                   str(engine.model), label))
        if engine.speculation is not None:
            # per-position counters give exact rates only when every verification had k_max
            # drafts (the fixed policy; record_acceptance checks the lengths); else the totals
            per_pos = llm.scheduler.stats().spec_num_accepted_tokens_per_pos or []
            fixed = engine.speculation.policy == "fixed"
            record_acceptance(dirs[-1], str(workload.desc.get("trace", "")),
                              per_pos if fixed else ())
        write_speed_probe(dirs[-1] / SPEED_PROBE_FILE, before, speed_probe(runner))
        log(f"real replay {i + 1}/{repeats}: {run.wall_time_s:.1f} s wall, "
            f"{len(run.steps)} steps")
    return dirs
