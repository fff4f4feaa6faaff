"""The twin of a real run: the same trace simulated with the real engine's settings.

The real run's ``config.json`` records its resolved engine arguments; the twin takes them on the
calibrated profile's device and resolves them with the same function the real engine used.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.simulator.acceptance import AcceptanceProfile
from twinserve.simulator.run import (
    SimConfig,
    SimResult,
    build_engine_config,
    simulate,
    write_sim_run,
)
from twinserve.traces import TraceRequest


def twin_config(real_config: dict[str, Any], model: str, profile: str | Path,
                log: Callable[[str], None] | None = None) -> SimConfig:
    """The ``SimConfig`` of the twin of a real run (``real_config``: its config.json). Where the
    profile sizes the KV cache differently from the machine (another memory figure), the real
    block counts are pinned, and ``log`` says so: the comparison is about step times, not
    memory."""
    given = {k: real_config[k] for k in EngineArgs.field_names()
             if k in real_config and k not in ("model", "device")}
    label = f"sim {real_config['scheduling_policy']}"
    cfg = SimConfig(EngineArgs.from_mapping(given, "the real run's config.json", model=model),
                    hardware=str(profile), label=label)
    resolved = build_engine_config(cfg).engine_config
    twin = resolved.scheduler
    real_blocks = (int(real_config["num_gpu_blocks"]), int(real_config.get("num_cpu_blocks", 0)))
    if (twin.num_gpu_blocks, twin.num_cpu_blocks) == real_blocks:
        return cfg
    if log is not None:
        log(f"the profile sizes {twin.num_gpu_blocks} KV blocks ({twin.num_cpu_blocks} host) "
            f"where the real engine had {real_blocks[0]} ({real_blocks[1]}): the twin uses "
            "the real counts")
    swap_space = (real_blocks[1] + 0.5) * resolved.block_bytes / 2**30
    return SimConfig(cfg.engine.replace(num_gpu_blocks_override=real_blocks[0],
                                        swap_space=swap_space),
                     hardware=str(profile), label=label)


def simulate_like(real_config: dict[str, Any], model: str, profile: str | Path,
                  trace: list[TraceRequest], out_dir: Path, trace_desc: dict[str, Any],
                  log: Callable[[str], None] | None = None,
                  acceptance: AcceptanceProfile | None = None) -> SimResult:
    """Simulates ``trace`` as the twin of a real run (``twin_config``) and writes its run folder
    to ``out_dir`` (the profile recorded in its config); ``acceptance``: the drafts' measured
    acceptance when the run speculated (recorded in the config too)."""
    result = simulate(twin_config(real_config, model, profile, log), trace, acceptance=acceptance)
    desc = {**trace_desc, "profile": str(profile)}
    if acceptance is not None:
        desc["acceptance_profile"] = acceptance.to_dict()
    write_sim_run(result, out_dir, desc)
    return result
