"""Twin against reality as a library: calibrate a profile from the real engine, replay a
workload for real, run its twin, compare them into an error table, run a study
(docs/fidelity-api.md).

    engine = EngineArgs(max_model_len=128, max_num_seqs=8)
    workload = TraceSpec("synthetic", num_requests=3, input_len=16, output_len=4).load()
    space = reachable_space(workload.requests, StepSpace(8, 128, 128))
    profile = calibrate(engine, "runs/x/profile.json", space=space).profile
    reals = replay(engine, workload, "runs/x", repeats=3)
    simulate_twin(profile, workload, reals[0], "runs/x/sim")
    print(compare("runs/x/sim", reals, profile).format())

It may import ``core``, ``policies``, ``traces``, ``simulator``, ``gpu`` and ``reports``; only
``entrypoints`` and ``benchmarks`` import it (``tests/test_layout.py``).
"""

from twinserve.fidelity.backend import load_runner, model_dir_or_default
from twinserve.fidelity.calibration import (
    CalibrationResult,
    calibrate,
    calibrate_from_runs,
    relevel,
)
from twinserve.fidelity.comparison import ErrorTable, compare
from twinserve.fidelity.profile_cache import ProfileCache, ProfileCacheKey, ProfileMeta
from twinserve.fidelity.progress import Progress
from twinserve.fidelity.replays import replay
from twinserve.fidelity.settings import CalibrationSettings
from twinserve.fidelity.step_space import StepSpace, reachable_space
from twinserve.fidelity.threads import measurement_threads
from twinserve.fidelity.twins import simulate_twin
from twinserve.fidelity.validation import ValidateSettings, ValidationResult, validate
from twinserve.fidelity.workload import TraceSpec, Workload

__all__ = [
    "CalibrationResult", "CalibrationSettings", "ErrorTable", "ProfileCache", "ProfileCacheKey",
    "ProfileMeta", "Progress", "StepSpace", "TraceSpec", "ValidateSettings", "ValidationResult",
    "Workload", "calibrate", "calibrate_from_runs", "compare", "load_runner",
    "measurement_threads", "model_dir_or_default", "reachable_space", "relevel", "replay",
    "simulate_twin", "validate",
]
