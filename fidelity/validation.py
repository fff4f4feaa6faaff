"""Twin against reality in one call: calibrate (or reuse a profile), replay, simulate, compare.

Without a profile, ``validate`` times only the step space its workload can reach within the
engine's limits (``reachable_space``), or reuses a cached profile of the same machine, model,
dtype, limits and kernel settings that covers it (``ProfileCache``); ``full_space`` times the
engine's whole space as ``twinserve calibrate`` does. The engine-loop workloads that set the
profile's level run before each replay, so the level is the host's during the replays' minutes
(``InterleavedCalibration``). docs/fidelity-api.md says what the shortcut gives up.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from twinserve.fidelity.acceptance import twin_acceptance
from twinserve.fidelity.backend import Log, load_runner, with_model
from twinserve.fidelity.comparison import ErrorTable, compare
from twinserve.fidelity.profile_cache import ProfileCache, ProfileCacheKey
from twinserve.fidelity.progress import Progress
from twinserve.fidelity.replays import replay
from twinserve.fidelity.settings import CalibrationSettings
from twinserve.fidelity.speeds import SPEEDS, at_speed, host_speeds, profile_fit, replay_speeds
from twinserve.fidelity.step_space import StepSpace, reachable_space
from twinserve.fidelity.twins import simulate_twin
from twinserve.fidelity.workload import Workload

if TYPE_CHECKING:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.worker.model_runner import ModelRunner
    from twinserve.traces import TraceRequest


@dataclass(slots=True, frozen=True)
class ValidateSettings:
    """``profile``: the twin's profile (``None``: calibrate, or reuse a cached one);
    ``reuse_real``: compare with these real run folders instead of replaying; ``real_repeats``:
    replays (the twin is judged against their median); ``at_speed``: ``host`` or ``replay`` to
    simulate at the replays' speed; ``profile_cache``: the cache folder (``None``: no cache);
    ``full_space``: calibrate over the engine's whole step space, not the workload's reach;
    ``acceptance_profile``: with speculation, the drafts' acceptance measured on other
    workloads that the twin replays, merged where several (empty: the replay's own,
    ``fidelity.acceptance``)."""

    profile: str | None = None
    reuse_real: tuple[Path, ...] = ()
    real_repeats: int = 1
    at_speed: str | None = None
    detokenize: bool = True
    profile_cache: Path | None = None
    full_space: bool = False
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    acceptance_profile: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if self.real_repeats < 1:
            raise ValueError(f"real_repeats must be >= 1, got {self.real_repeats}.")
        if self.at_speed is not None and self.at_speed not in SPEEDS:
            raise ValueError(f"at_speed must be one of {', '.join(SPEEDS)}, got "
                             f"{self.at_speed!r}.")
        if self.reuse_real and self.profile is None:
            raise ValueError("--reuse-real needs --profile (no backend is loaded to calibrate).")


@dataclass(slots=True, frozen=True)
class ValidationResult:
    """The error table, the real run folders, the twin's, the profile it ran on with where
    that came from (``profile_source``: given, cached or calibrated), the scheduling policy."""

    table: ErrorTable
    real_runs: tuple[Path, ...]
    twin_run: Path
    profile: Path
    profile_source: str
    policy: str
    kernel_mismatch: str | None = None


def validate(engine: EngineArgs, workload: Workload, out: str | Path,
             settings: ValidateSettings | None = None, log: Log | None = None,
             weights_from: ModelRunner | None = None,
             progress: Progress | None = None) -> ValidationResult:
    """Replays ``workload`` on ``engine`` (``settings.real_repeats`` times; on ``weights_from``'s
    weights when given), simulates its twin and compares them; writes ``out/real*``,
    ``out/sim``, ``out/errors.csv`` (and ``repeatability.csv``, ``profile.json``). ``progress``
    (instead of ``log``): messages and a bar with the time left."""
    settings = settings or ValidateSettings()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    engine = with_model(engine)
    log = progress or log or (lambda msg: None)
    if settings.reuse_real:
        real_dirs, profile = list(settings.reuse_real), Path(str(settings.profile))
        source = f"given ({profile})"
    else:
        real_dirs, profile, source = _replays(engine, workload, out, settings, log, weights_from,
                                              progress)
    model = str(engine.model)
    base_profile = profile
    if settings.at_speed is not None:
        profile = scaled_profile(profile, real_dirs, model, settings.at_speed, out, log)
    twin_dir = out / "sim"
    acceptance = twin_acceptance(real_dirs[0], settings.acceptance_profile, log)
    simulate_twin(profile, workload, real_dirs[0], twin_dir, model, log, acceptance)
    policy = _policy(real_dirs[0])  # (the real runs' own, as replayed)
    table = compare(twin_dir, real_dirs, profile, model, speed_profile=base_profile,
                    title=f"sim vs real ({policy}, {len(workload.requests)} requests, "
                          f"{len(real_dirs)} real run(s), profile {profile})")
    table.write(out)
    mismatch = kernel_mismatch(base_profile, engine, real_dirs[0], workload.requests)
    if mismatch is not None:
        log(f"WARNING: {mismatch}")
    return ValidationResult(table, tuple(real_dirs), twin_dir, Path(profile), source, policy,
                            mismatch)


def kernel_mismatch(profile: str | Path, engine: EngineArgs, real_dir: Path,
                    requests: Sequence[TraceRequest] = ()) -> str | None:
    """How the kernels ``profile``'s fit was measured under differ from the ones the engine
    ran, and where the real run's limits, within what ``requests`` reach
    (``reachable_space``), pass the fit's measured steps (None: neither): a profile
    calibrated under other kernels, or on smaller steps, predicts other step times."""
    from twinserve.core.kernel_settings import kernel_settings_mismatch
    from twinserve.simulator.hardware import STEP_SPACE_KEYS
    config = json.loads((real_dir / "config.json").read_text())
    fit = profile_fit(profile, str(engine.model), int(config.get("tensor_parallel_size", 1)))
    if fit is None:
        return None
    spec = config.get("speculative_config") or {}
    k = int(spec.get("max_num_speculative_tokens") or spec.get("num_speculative_tokens") or 0)
    beyond = ""
    if all(config.get(key) for key in STEP_SPACE_KEYS):
        limits = StepSpace(*(int(config[key]) for key in STEP_SPACE_KEYS))
        reach = reachable_space(requests, limits) if requests else limits
        beyond = fit.beyond(dict(zip(STEP_SPACE_KEYS, reach.as_tuple())), k)
    differ = "; ".join(p for p in (kernel_settings_mismatch(fit.to_dict(),
                                                            engine.kernel_settings()), beyond) if p)
    return f"profile {profile}: {differ}" if differ else None


def _policy(real_dir: Path) -> str:
    return str(json.loads((real_dir / "config.json").read_text())["scheduling_policy"])


def scaled_profile(profile: Path, real_dirs: list[Path], model: str, which: str, out: Path,
            log: Log) -> Path:
    """The profile at the replays' ``which`` speed (``speeds.at_speed``), written to
    ``out/profile-at-<which>-speed.json``."""
    from twinserve.core.step_sample import read_recorded_samples
    tp = int(json.loads((real_dirs[0] / "config.json").read_text()).get("tensor_parallel_size", 1))
    fit = profile_fit(profile, model, tp)
    speeds = (host_speeds(real_dirs, fit) if which == "host" else
              replay_speeds([read_recorded_samples([d]) for d in real_dirs], fit))
    scaled = at_speed(profile, speeds, which, out / f"profile-at-{which}-speed.json")
    log(f"profile at the replays' {which} speed ({statistics.median(speeds):.3f}x the "
        f"calibration's time): {scaled}")
    return scaled


def _replays(engine: EngineArgs, workload: Workload, out: Path, settings: ValidateSettings,
             log: Log, weights_from: ModelRunner | None,
             progress: Progress | None) -> tuple[list[Path], Path, str]:
    """The real replays and the twin's profile: given, cached, or calibrated on this model load
    (the grid first, the engine loop before each replay)."""
    from twinserve.fidelity.interleaved import InterleavedCalibration
    from twinserve.fidelity.threads import set_threads
    cal_settings = settings.calibration
    set_threads(cal_settings.num_threads)
    runner = load_runner(engine, weights_from)
    log(f"real engine: {runner.device} {runner.dtype}, {runner.num_gpu_blocks} KV blocks; "
        f"{len(workload.requests)} requests")
    known, source, space = _known_profile(engine, runner, workload, settings, out)
    repeats = settings.real_repeats
    if known is not None:
        if progress is not None:
            progress.expect(repeats)
        log(f"profile: {source}")
        return replay(engine, workload, out, repeats, runner, None, log,
                      detokenize=settings.detokenize), known, source
    cal = InterleavedCalibration(cal_settings, engine, runner, log, space=space)
    if progress is not None:
        loop = (1 + cal.num_loop_parts()) if cal_settings.engine_loop else 0
        progress.expect(cal_settings.warmup + cal_settings.repeats + repeats * (loop + 1))
    log(f"profile: calibrating over {_describe(space)}")
    cal.measure_grid()
    dirs = replay(engine, workload, out, repeats, runner, cal.measure_level, log,
                  detokenize=settings.detokenize)
    quick = " (quick)" if cal_settings.quick else ""
    profile = cal.save(out / "profile.json", f"Calibrated by validate{quick} on the model load "
                       "it replayed on.")
    source = f"calibrated over {_describe(space)}"
    if settings.profile_cache is not None and space is not None:
        key = _cache_key(engine, runner, cal_settings)
        source += f", cached as {ProfileCache(settings.profile_cache).store(profile, key, space)}"
    return dirs, profile, source


def _known_profile(engine: EngineArgs, runner: ModelRunner, workload: Workload,
                   settings: ValidateSettings, out: Path
                   ) -> tuple[Path | None, str, StepSpace | None]:
    """The given profile, else a cached one covering the workload's reach (copied to
    ``out/profile.json``), else ``None`` with the space to calibrate over."""
    if settings.profile is not None:
        return Path(settings.profile), f"given ({settings.profile})", None
    limits = runner.engine_config.scheduler
    engine_space = StepSpace(limits.max_num_seqs, limits.max_num_batched_tokens,
                             runner.max_model_len)
    space = engine_space if settings.full_space else reachable_space(workload.requests,
                                                                    engine_space)
    if settings.profile_cache is not None:
        key = _cache_key(engine, runner, settings.calibration)
        cached = ProfileCache(settings.profile_cache).find(key, space)
        if cached is not None:
            profile = Path(shutil.copyfile(cached, out / "profile.json"))
            return profile, f"cached ({cached}, covering {_describe(space)})", None
    return None, "", space


def _cache_key(engine: EngineArgs, runner: ModelRunner,
               settings: CalibrationSettings) -> ProfileCacheKey:
    kernels = {k: str(v) for k, v in engine.kernel_settings().to_dict().items()}
    return ProfileCacheKey.of_runner(runner, engine, settings.num_threads, settings.quick,
                                     settings.engine_loop, kernel_settings=kernels)


def _describe(space: StepSpace | None) -> str:
    if space is None:
        return "the engine's whole step space"
    return (f"batches up to {space.max_num_seqs}, steps up to {space.max_num_batched_tokens} "
            f"tokens, contexts up to {space.max_model_len}")
