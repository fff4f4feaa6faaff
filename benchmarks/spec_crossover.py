"""Where fixed-k speculation stops paying: the twin over request rates with no speculation,
fixed k = 4 and the adaptive policy, on a default GPU (Llama-3-8B on an A100-80GB) and on this
CPU's calibrated profile (the bundled SmolLM2-135M; a cached profile, else a quick
calibration), printing mean TPOT and throughput per rate, the rate where fixed k's TPOT first
reaches none's (the crossover, interpolated between grid rates) and adaptive's worst ratio to
none.

    python -m twinserve.benchmarks.spec_crossover [--acceptance-rate 0.7 | --acceptance-profile F]
        [--num-requests 300] [--gpu-only | --cpu-only] [--real]

``--real`` then measures the same on this CPU with the real engine (bundled model, a few rates,
short runs, ngram drafts verified for real) and prints the twin's prediction at those rates
beside it: pass the ``--acceptance-profile`` of a real replay of this kind of workload (a
``validate`` run folder's ``acceptance.json``), so that the twin proposes and accepts as the
engine does. With ``--real`` the CPU profile is first re-levelled to the host's speed now
(``fidelity.relevel``, the factor printed; ``--no-relevel`` keeps it as cached): a profile
calibrated on a busier or quieter host would otherwise put the twin's TPOT off by the drift,
and the crossover with it. ``--fresh-processes`` runs each real replay in a spawned process of
its own: in one process, the speculating replays ran 5-9% slower than alone.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.simulator import SimConfig, simulate
from twinserve.simulator.acceptance import AcceptanceProfile
from twinserve.traces import SyntheticConfig, synthetic_trace

K = 4
MODES = ("none", f"fixed k={K}", "adaptive")


@dataclass(frozen=True, slots=True)
class Setting:
    """A model on a hardware profile, with the engine limits and the rates to sweep."""

    name: str
    model: str
    hardware: str
    rates: tuple[float, ...]
    input_len: int
    output_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None = None


GPU = Setting("A100-80GB, Llama-3-8B (Vidur fit)", "llama-3-8b", "a100-80gb",
              (1, 2, 4, 8, 12, 16, 24, 32), 512, 256, 256, 8192)


def speculative_config(mode: str, rates: Sequence[float] | None) -> dict[str, Any] | None:
    """ngram drafts under ``mode``'s policy; ``rates``: synthetic acceptance (None: the real
    verification, greedy as the replays sample)."""
    if mode == "none":
        return None
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": K,
                            "policy": "fixed" if mode.startswith("fixed") else "adaptive"}
    if rates is not None:
        spec.update(rejection_sample_method="synthetic", synthetic_acceptance_rate=list(rates))
    return spec


def twin_point(setting: Setting, mode: str, rate: float, rates: Sequence[float],
               num_requests: int, profile: AcceptanceProfile | None = None,
               seed: int = 0) -> dict[str, float]:
    """The twin at ``rate``: acceptance ``profile`` when given (with its proposal rate and
    draft lengths), else the synthetic ``rates``."""
    trace = synthetic_trace(SyntheticConfig(num_requests=num_requests, request_rate=rate,
                                            input_len=setting.input_len,
                                            output_len=setting.output_len, seed=seed))
    limits: dict[str, Any] = {"max_num_seqs": setting.max_num_seqs,
                              "max_num_batched_tokens": setting.max_num_batched_tokens}
    if setting.max_model_len is not None:
        limits["max_model_len"] = setting.max_model_len
    spec = speculative_config(mode, None if profile is not None else rates)
    args = EngineArgs(model=setting.model, speculative_config=spec, **limits)
    s = simulate(SimConfig(args, hardware=setting.hardware), trace, acceptance=profile).summary
    return {"tpot": s["mean_tpot_ms"], "throughput": s["output_throughput"],
            "length": s.get("spec_mean_acceptance_length", 1.0)}


def crossover(rates: Sequence[float], ratio: Sequence[float]) -> float | None:
    """The first rate where ``ratio`` (fixed TPOT / none TPOT) reaches 1, interpolated
    linearly between the grid rates around it (None: fixed k pays at every rate)."""
    for i, r in enumerate(ratio):
        if r >= 1.0:
            if i == 0:
                return rates[0]
            lo, hi = ratio[i - 1], r
            return rates[i - 1] + (1.0 - lo) / (hi - lo) * (rates[i] - rates[i - 1])
    return None


def sweep(setting: Setting, point: Any, rates: Sequence[float]) -> dict[str, list[dict[str, float]]]:
    """Every mode at every rate, rate by rate with the modes' order rotating (a real host's
    drift then falls on all modes alike)."""
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for i, rate in enumerate(setting.rates):
        for mode in MODES[i % len(MODES):] + MODES[:i % len(MODES)]:
            results[mode].append(point(setting, mode, rate, rates))
    return results


def report(title: str, setting: Setting, results: dict[str, list[dict[str, float]]]) -> str:
    none, fixed, adaptive = (results[m] for m in MODES)
    fixed_ratio = [f["tpot"] / n["tpot"] for f, n in zip(fixed, none)]
    adaptive_ratio = [a["tpot"] / n["tpot"] for a, n in zip(adaptive, none)]
    lines = [f"\n{title}: {setting.name}, {setting.input_len} in / {setting.output_len} out, "
             f"max_num_seqs {setting.max_num_seqs}",
             f"{'rate':>6} | " + " | ".join(f"{m:>24}" for m in MODES)
             + " | fixed/none | adaptive/none",
             f"{'req/s':>6} | " + " | ".join(f"{'TPOT ms  tok/s  acc.len':>24}" for _ in MODES)
             + " |   TPOT     |   TPOT"]
    for i, rate in enumerate(setting.rates):
        cells = " | ".join(f"{r[i]['tpot']:8.2f} {r[i]['throughput']:7.1f} {r[i]['length']:6.2f}"
                           for r in (none, fixed, adaptive))
        lines.append(f"{rate:6g} | {cells} | {fixed_ratio[i]:10.3f} | {adaptive_ratio[i]:8.3f}")
    cross = crossover(setting.rates, fixed_ratio)
    where = (f"~{cross:.3g} req/s" if cross is not None
             else f"no rate up to {setting.rates[-1]:g} req/s")
    lines.append(f"fixed k={K} stops paying at {where}")
    worst = max(adaptive_ratio)
    lines.append(f"adaptive vs none: worst TPOT ratio {worst:.3f} "
                 f"({'never slower' if worst <= 1.0 else 'slower' if worst > 1.03 else 'within 3%'})")
    return "\n".join(lines)


def cpu_profile() -> tuple[str, str, int]:
    """The bundled model's directory, this CPU's calibrated profile (the cached one with the
    most step tokens that covers contexts of 128, else a quick calibration, cached) and the
    torch threads it was measured on, which real replays compared with it must run on."""
    from twinserve.fidelity import calibrate
    from twinserve.fidelity.backend import model_dir_or_default
    from twinserve.fidelity.profile_cache import ProfileMeta, default_folder
    from twinserve.fidelity.settings import CalibrationSettings
    model_dir = model_dir_or_default(None)
    best: tuple[int, Path, int] | None = None
    for meta_path in default_folder().glob("*.meta.json"):
        meta = ProfileMeta.read(meta_path)
        if meta is None or meta.key.model != model_dir or meta.space.max_model_len < 128:
            continue
        profile = meta_path.with_name(meta_path.name.removesuffix(".meta.json") + ".json")
        if profile.is_file() and (best is None or meta.space.max_num_batched_tokens > best[0]):
            best = (meta.space.max_num_batched_tokens, profile, meta.key.threads)
    if best is not None:
        return model_dir, str(best[1]), best[2]
    out = default_folder() / "spec-crossover-quick.json"
    engine = EngineArgs(max_model_len=128, max_num_seqs=40, max_num_batched_tokens=2048)
    settings = CalibrationSettings(quick=True)
    calibrate(engine, out, settings)
    return model_dir, str(out), settings.num_threads


def relevelled(model_dir: str, profile: str) -> str:
    """``profile`` scaled to the host's speed now (a temporary file), the factor printed."""
    from twinserve.fidelity import relevel
    out = Path(tempfile.mkdtemp(prefix="spec-crossover-")) / "profile-at-host-speed.json"
    engine = EngineArgs(model=model_dir, max_model_len=128, max_num_seqs=40,
                        max_num_batched_tokens=2048)
    path, factor = relevel(profile, engine, out)
    print(f"CPU profile re-levelled to the host's speed now: step times x{factor:.3f} ({path})")
    return str(path)


def real_points(num_requests: int, folder: Path, fresh: bool = False, threads: int = 1) -> Any:
    """A point function that replays the workload on this CPU's real engine: one load of the
    bundled model's weights for all points, one runner per mode, each warmed by one replay; or
    (``fresh``) each point in a spawned process of its own on ``threads`` torch threads, warmed
    by a replay of 16 requests, as a deployment runs one mode (in one process the speculating
    replays ran 5-9% slower than alone)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    runners: dict[str, Any] = {}  # one runner per mode (its proposer), on one load of weights

    def point(setting: Setting, mode: str, rate: float, rates: Sequence[float]) -> dict[str, float]:
        if not fresh:
            return _real_point(setting, mode, rate, num_requests, folder, runners)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(_fresh_point, setting, mode, rate, num_requests, folder,
                               threads).result()
    return point


def _real_point(setting: Setting, mode: str, rate: float, num_requests: int, folder: Path,
                runners: dict[str, Any], warm_requests: int | None = None) -> dict[str, float]:
    """One real replay of ``mode`` at ``rate`` on the runner ``runners`` holds for the mode,
    made (and warmed by a replay of ``warm_requests``, default the workload's) when absent."""
    import json

    from twinserve.fidelity import replay
    from twinserve.fidelity.backend import load_runner
    from twinserve.fidelity.workload import TraceSpec
    engine = EngineArgs(model=setting.model, max_model_len=setting.max_model_len,
                        max_num_seqs=setting.max_num_seqs,
                        max_num_batched_tokens=setting.max_num_batched_tokens,
                        speculative_config=speculative_config(mode, None))

    def workload(n: int) -> Any:
        return TraceSpec("synthetic", num_requests=n, request_rate=rate,
                         input_len=setting.input_len, output_len=setting.output_len,
                         max_model_len=setting.max_model_len).load()
    runner = runners.get(mode)
    if runner is None:
        runner = runners[mode] = load_runner(engine, next(iter(runners.values()), None))
        replay(engine, workload(warm_requests or num_requests),
               folder / f"warmup-{mode.split()[0]}-{rate:g}", runner=runner)
    run = replay(engine, workload(num_requests), folder / f"{mode.split()[0]}-{rate:g}",
                 runner=runner)[0]
    s = json.loads((run / "summary.json").read_text())
    return {"tpot": s["mean_tpot_ms"], "throughput": s["output_throughput"],
            "length": s.get("spec_mean_acceptance_length", 1.0)}


def _fresh_point(setting: Setting, mode: str, rate: float, num_requests: int, folder: Path,
                 threads: int) -> dict[str, float]:
    """``_real_point`` in a process of its own (the spawned child's entry)."""
    from twinserve.fidelity.threads import set_threads
    set_threads(threads)
    return _real_point(setting, mode, rate, num_requests, folder, {}, warm_requests=16)


def lookup_costs(steps: int = 40, context: int = 300) -> dict[str, tuple[float, float]]:
    """Seconds per step and per sequence of the ngram and suffix proposers on this host: each
    proposes k drafts for batches of 1 and 32 requests whose tokens grow one per step (ids of
    a 500-token vocabulary, so matches occur), and the two batch sizes give the two terms. The
    first proposal (a suffix trie's build over the prompt) is left out: it happens once."""
    import random
    import time

    from twinserve.core.request import Request
    from twinserve.core.sampling_params import SamplingParams
    from twinserve.spec_decode.ngram import NgramProposer
    from twinserve.spec_decode.suffix import SuffixProposer
    rng = random.Random(0)
    costs = {}
    for name, make in (("ngram", NgramProposer), ("suffix", SuffixProposer)):
        per_batch = []
        for batch in (1, 32):
            proposer = make()
            requests = [Request(f"r{i}", [rng.randrange(500) for _ in range(context)],
                                SamplingParams(max_tokens=steps + 1), 0.0) for i in range(batch)]
            proposer.propose([(r, K) for r in requests])  # a suffix trie is built once
            t0 = time.perf_counter()
            for _ in range(steps):
                for r in requests:
                    r.append_output_token(rng.randrange(500), 0.0)
                proposer.propose([(r, K) for r in requests])
            per_batch.append((time.perf_counter() - t0) / steps)
        per_seq = max(0.0, (per_batch[1] - per_batch[0]) / 31)
        costs[name] = (max(0.0, per_batch[0] - per_seq), per_seq)
    return costs


def cpu_setting(model_dir: str, profile: str) -> Setting:
    return Setting(f"this CPU's calibrated profile ({profile}), SmolLM2-135M", model_dir, profile,
                   (0.5, 1, 2, 4, 6, 8, 12, 16), 64, 48, 40, 2048, 128)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--acceptance-rate", type=float, default=0.7,
                   help="conditional acceptance per draft position (default 0.7)")
    p.add_argument("--acceptance-profile", default=None, help="a measured profile instead")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--gpu-only", action="store_true")
    p.add_argument("--cpu-only", action="store_true")
    p.add_argument("--real", action="store_true", help="also measure on this CPU's real engine")
    p.add_argument("--real-rates", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    p.add_argument("--real-requests", type=int, default=24)
    p.add_argument("--twin-at-real-rates", action="store_true",
                   help="the twin at --real-rates with --real-requests requests, without --real")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="the CPU twin's profile (default: the cached calibration of the bundled "
                        "model with the most step tokens); with --real, replays run on --threads")
    p.add_argument("--fresh-processes", action="store_true",
                   help="with --real, each real replay in a spawned process of its own")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the real replays with --profile (default 1)")
    p.add_argument("--no-relevel", dest="relevel", action="store_false",
                   help="with --real: keep the cached CPU profile's level (default: re-level it "
                        "to the host's speed now)")
    p.add_argument("--lookup-costs", action="store_true",
                   help="only time the ngram and suffix proposers on this host and exit")
    args = p.parse_args(argv)
    if args.fresh_processes and not args.real:
        p.error("--fresh-processes needs --real (it runs the real replays)")
    if args.threads is not None and args.profile is None:
        p.error("--threads needs --profile (the cached profile's own threads are used)")
    if args.twin_at_real_rates and args.gpu_only:
        p.error("--twin-at-real-rates needs the CPU setting (not --gpu-only)")
    if args.lookup_costs:
        for name, (per_step, per_seq) in lookup_costs().items():
            print(f"{name}: {per_step * 1e6:.1f} us per step + {per_seq * 1e6:.1f} us per sequence")
        return 0
    profile = AcceptanceProfile.load(args.acceptance_profile) if args.acceptance_profile else None
    rates: tuple[float, ...] = profile.rates if profile is not None else (args.acceptance_rate,)
    expected = sum(math.prod(rates[min(i, len(rates) - 1)] for i in range(j + 1)) for j in range(K))
    print(f"acceptance per position {list(rates)}: mean acceptance length at k={K} "
          f"{1 + expected:.2f}" + ("" if profile is None else
                                   f" (measured on {profile.workload}: drafts found in "
                                   f"{profile.proposal_rate:.0%} of steps, "
                                   f"{profile.mean_draft_length or K:.2f} long)"))

    def point(setting: Setting, mode: str, rate: float, r: Sequence[float]) -> dict[str, float]:
        return twin_point(setting, mode, rate, r, args.num_requests, profile)

    if not args.cpu_only:
        print(report("twin", GPU, sweep(GPU, point, rates)))
    if not args.gpu_only:
        if args.profile is None:
            model_dir, hardware, threads = cpu_profile()
        else:
            from twinserve.fidelity.backend import model_dir_or_default
            model_dir, hardware, threads = model_dir_or_default(None), args.profile, args.threads or 1
        if args.real:
            from twinserve.fidelity.threads import set_threads
            set_threads(threads)  # the profile's: the probe and the replays run as it was timed
        if args.real and args.relevel:
            hardware = relevelled(model_dir, hardware)
        setting = cpu_setting(model_dir, hardware)
        print(report("twin", setting, sweep(setting, point, rates)))
        if args.real or args.twin_at_real_rates:
            real = Setting(setting.name, setting.model, setting.hardware, args.real_rates,
                           setting.input_len, setting.output_len, setting.max_num_seqs,
                           setting.max_num_batched_tokens, setting.max_model_len)
            def real_sized(setting: Setting, mode: str, rate: float,
                           r: Sequence[float]) -> dict[str, float]:  # the replays' request count
                return twin_point(setting, mode, rate, r, args.real_requests, profile)
            twin = sweep(real, real_sized, rates)
            print(report("twin at the real rates", real, twin))
        if args.real:
            with tempfile.TemporaryDirectory() as folder:
                measured = sweep(real, real_points(args.real_requests, Path(folder),
                                                   args.fresh_processes, threads), rates)
            print(report("real engine", real, measured))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
