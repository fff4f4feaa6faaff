"""The twin of a real run: its workload simulated with the run's engine settings on a profile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twinserve.fidelity.backend import Log
from twinserve.fidelity.workload import Workload
from twinserve.simulator.acceptance import AcceptanceProfile


def simulate_twin(profile: str | Path, workload: Workload, real_run: str | Path,
                  out: str | Path, model: str | None = None,
                  log: Log | None = None,
                  acceptance: AcceptanceProfile | None = None) -> dict[str, Any]:
    """Simulates ``workload`` as the twin of the real run folder ``real_run`` (its resolved engine
    settings, its KV block counts) on ``profile``, writes the twin's run folder to ``out`` and
    returns its summary. ``model``: the model directory (default: the run's); ``acceptance``:
    the drafts' acceptance the twin replays when the run speculated (``fidelity.acceptance``)."""
    from twinserve.simulator.twin_of_run import simulate_like
    config = json.loads((Path(real_run) / "config.json").read_text())
    model = model or config.get("model")
    if not model:
        raise ValueError(f"simulate_twin: {real_run}/config.json names no model: pass model.")
    result = simulate_like(config, str(model), profile, list(workload.requests), Path(out),
                           dict(workload.desc), log, acceptance)
    return result.summary
