"""``twinserve plan --verify-top K``: the top K configurations this machine can run, replayed on the
real engine at their predicted capacity and one step of the search's grid above it, predicted
against measured attainment at both, and a verdict per configuration (``planner.verify``:
tight, pessimistic, optimistic). Writes ``OUT/verify.csv`` and the real run folders
``OUT/verify/<id>/{at,above}/real``.

An aggregated configuration replays through ``fidelity.replays.replay`` (one engine, its model
loaded once for both rates); one of several replicas through the machinery of ``validate
--data-parallel-size N`` (``entrypoints/cli/validate_dp.py``: the data-parallel front over N
engine processes behind the configuration's router, priced from the profile as the twin prices
it); an xPyD one through that of ``validate --prefill-instances X --decode-instances Y``
(``entrypoints/cli/validate_pd.py``: the P/D front over X + Y engine processes). Each writes a
run folder, so the real columns are the same every way.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twinserve.planner.slo import FAIL
from twinserve.traces import TraceRequest

BUNDLED_REAL = ("smollm2-135m", "smollm2-135m-instruct")  # the real engine's embedded model
PD_KEYS = ("prefill_instances", "decode_instances", "kv_link", "prefill_args", "decode_args")
RealReplay = Callable[[list[TraceRequest], Path], Path]  # requests, folder -> run folder


def verifiable(row: dict[str, Any], model: str) -> str:
    """Why this machine cannot run ``row`` on the real engine ("" when it can): the model must be
    a checkpoint directory or the bundled SmolLM2-135M, the profile's device type this machine's,
    with as many devices as the configuration needs (a CPU counts as one). An xPyD deployment
    runs as ``validate --prefill-instances`` does: one device per instance (no TP or PP), and on
    a CPU one core per instance at least (each instance pins its share of the cores)."""
    from twinserve.simulator.hardware import load_hardware
    if _real_model(model) is False:
        return f"the real engine needs a checkpoint of {model!r}; here only the bundled smollm2-135m"
    wanted = load_hardware(row["hardware"]).platform().device_type
    have, count = _devices()
    if wanted != have:
        return f"needs {row['gpus']} x {row['hardware']} ({wanted}); this machine has {have}"
    if row.get("prefill_instances"):
        return _pd_verifiable(row, have, count)
    if have == "cpu" and int(row.get("num_replicas") or 1) > 1:
        return _dp_verifiable(row)
    if row["gpus"] > count:
        return f"needs {row['gpus']} devices; this machine has {count}"
    return ""


def _dp_verifiable(row: dict[str, Any]) -> str:
    """Replicas on a CPU run as ``validate --data-parallel-size`` does: each replica's ranks
    on cores of their own (the one-thread profile's assumption)."""
    from twinserve.gpu.worker.cpu_cores import usable_cores
    ranks = row["gpus"]  # (replicas x TP x PP)
    if ranks > usable_cores():
        return (f"{row['num_replicas']} replicas run {ranks} worker ranks, each on a core of "
                f"its own; this machine has {usable_cores()} usable cores")
    return ""


def _pd_verifiable(row: dict[str, Any], device: str, count: int) -> str:
    from twinserve.gpu.worker.cpu_cores import usable_cores
    size = int(row["prefill_instances"]) + int(row["decode_instances"])
    shape = f"{row['prefill_instances']}P{row['decode_instances']}D"
    if row["tensor_parallel_size"] > 1 or row["pipeline_parallel_size"] > 1:
        return f"{shape} at TP/PP > 1: a real P/D replay runs one device per instance"
    if device == "cpu" and size > usable_cores():
        return (f"{shape} runs {size} instances, each on at least one core of its own; this "
                f"machine has {usable_cores()} usable cores")
    if device != "cpu" and size > count:
        return f"{shape} needs {size} devices, one per instance; this machine has {count}"
    return ""


def _real_model(model: str) -> str | None | bool:
    """The real engine's model for the plan's: a directory as it is, ``None`` (the bundled one)
    for smollm2-135m, ``False`` for a model this machine has no weights of."""
    if Path(model).is_dir():
        return model
    return None if model.lower() in BUNDLED_REAL else False


def _devices() -> tuple[str, int]:
    import torch
    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    return "cpu", 1


def verify_top(result: Any, spec: Any, out: Path, k: int) -> list[dict[str, Any]]:
    """Verifies the top ``k`` fitted configurations (those this machine cannot run get their
    reason); prints and returns the rows of ``verify.csv``."""
    import pandas as pd

    from twinserve.planner.verify import TwinSide
    twin = TwinSide(spec, out)
    rows = []
    for row in result.fitted()[:k]:
        why = verifiable(row, spec.space.model)
        entry = {"name": row["name"], "capacity_rps": row["capacity_rps"], "verifiable": not why,
                 "reason": why}
        if not why:
            entry.update(_verify_row(row, spec, twin, out / "verify" / row["candidate_id"]))
        rows.append(entry)
    pd.DataFrame(rows).to_csv(out / "verify.csv", index=False)
    for entry in rows:
        print(_printout(entry, [s.key for s in spec.slos]))
    return rows


def _printout(entry: dict[str, Any], slos: list[str]) -> str:
    """One configuration: its verdict, then predicted against measured at both rates."""
    import pandas as pd
    if not entry["verifiable"]:
        return f"{entry['name']}: not verified ({entry['reason']})"
    lines = []
    for suffix, rate in (("", entry["capacity_rps"]), ("_above", entry["rate_above_rps"])):
        line = {"rate_rps": rate, "twin": entry[f"predicted_verdict{suffix}"],
                **{f"twin {k}": entry[f"predicted_attainment{suffix}_{k}"] for k in slos},
                "real": entry.get(f"measured_verdict{suffix}", "not replayed")}
        line.update({f"real {k}": entry.get(f"measured_attainment{suffix}_{k}") for k in slos})
        lines.append(line)
    table = pd.DataFrame(lines, index=["at capacity", "one step above"])
    return (f"{entry['name']}: {entry['capacity_verdict']} ({_story(entry)})\n"
            + table.to_string(float_format=lambda v: f"{v:.4g}", na_rep="-"))


def _verify_row(row: dict[str, Any], spec: Any, twin: Any, folder: Path) -> dict[str, Any]:
    """Predicted and measured attainment at capacity and one step above (columns ``*_above``),
    the verdict."""
    from twinserve.planner.output import _sim_of, best_config
    from twinserve.planner.verify import VerifyRates, capacity_verdict
    rates = VerifyRates.of(row["capacity_rps"], twin.grid)
    real = _real_replay(best_config(row, spec), spec.space.model, spec.trace, row["hardware"])
    sim = _sim_of(row, spec)
    entry: dict[str, Any] = {"rate_above_rps": rates.above_rps}
    for suffix, k in (("", rates.capacity_index), ("_above", rates.capacity_index + 1)):
        point = twin.point(row, sim, k)
        entry[f"predicted_verdict{suffix}"] = point["verdict"]
        # per SLO, the share of requests within it (not a latency)
        entry.update({f"predicted_attainment{suffix}_{key}": v
                      for key, v in point["attainment"].items()})
        if suffix and entry["measured_verdict"] == FAIL:
            break  # decided: planner.verify
        requests = twin.requests(twin.grid.rate(k))  # the twin's own
        run = real(requests, folder / ("above" if suffix else "at"))
        verdict, measured = _measured(run, spec, len(requests))
        entry.update({f"measured_verdict{suffix}": verdict, f"folder{suffix}": str(run),
                      **{f"measured_attainment{suffix}_{key}": v for key, v in measured.items()}})
    entry["capacity_verdict"] = capacity_verdict(entry["measured_verdict"],
                                                 entry.get("measured_verdict_above"))
    return entry


def _story(entry: dict[str, Any]) -> str:
    at = f"{entry['measured_verdict']} at {entry['capacity_rps']:.4g} req/s"
    if "measured_verdict_above" not in entry:
        return f"{at} for real; not replayed above"
    return f"{at}, {entry['measured_verdict_above']} at {entry['rate_above_rps']:.4g} req/s for real"


def _measured(run: Path, spec: Any, sent: int) -> tuple[str, dict[str, float]]:
    import pandas as pd

    from twinserve.planner.slo import table_verdict
    table = pd.read_csv(run / "requests.csv")
    values = {m: table[f"{m}_ms"].tolist() for m in ("ttft", "tpot", "e2el")}
    return table_verdict(table["success"].astype(bool).tolist(), values, spec.slos, sent)


def _real_replay(config: dict[str, Any], model: str, trace_name: str, hardware: str) -> RealReplay:
    """How this configuration replays for real: one engine (its model loaded once), or the xPyD
    deployment behind the P/D front."""
    from twinserve.fidelity.backend import with_model
    from twinserve.fidelity.workload import Workload
    engine = with_model(_engine_of(config, _real_model(model)))
    desc = {"trace": trace_name}
    if "prefill_instances" in config:
        return _pd_replay(engine, config, desc, hardware)
    if engine.data_parallel_size > 1:
        return _dp_replay(engine, desc, hardware)
    from twinserve.fidelity.backend import load_runner
    from twinserve.fidelity.replays import replay
    from twinserve.fidelity.threads import measurement_threads, set_threads
    if engine.device != "cuda":  # the threads calibrate times a CPU profile on, as validate
        set_threads(measurement_threads())
    runner = load_runner(engine)
    return lambda requests, folder: replay(engine, Workload(tuple(requests), desc), folder,
                                           runner=runner)[0]


def _pd_replay(engine: Any, config: dict[str, Any], desc: dict[str, Any],
               hardware: str) -> RealReplay:
    from twinserve.core.model_config import ModelConfig
    from twinserve.entrypoints.cli.validate_pd import check_pd_validate, replay_pd, write_real
    from twinserve.entrypoints.pd_front import PDDeployment
    from twinserve.gpu.models.default_model import resolve_model_source
    check_pd_validate(argparse.Namespace(profile=hardware), engine)  # what validate refuses
    pd = PDDeployment(config["prefill_instances"], config["decode_instances"],
                      config.get("prefill_args") or {}, config.get("decode_args") or {})
    vocab = ModelConfig.from_dir(resolve_model_source(str(engine.model))[0]).vocab_size

    def run(requests: list[TraceRequest], folder: Path) -> Path:
        real = replay_pd(engine, pd, requests, vocab)
        return write_real(real, requests, pd, folder / "real", engine, desc)  # (as replay's)
    return run


def _dp_replay(engine: Any, desc: dict[str, Any], hardware: str) -> RealReplay:
    """Replicas behind the configuration's router: the data-parallel front, a fresh fleet per
    replay, its router priced from the profile (``validate --data-parallel-size``'s way)."""
    from twinserve.core.model_config import ModelConfig
    from twinserve.entrypoints.cli.validate_dp import (
        profile_prices,
        replay_fleet_records,
        write_real,
    )
    from twinserve.gpu.models.default_model import resolve_model_source
    from twinserve.routers import make_router
    vocab = ModelConfig.from_dir(resolve_model_source(str(engine.model))[0]).vocab_size
    prices = profile_prices(engine, hardware)

    def run(requests: list[TraceRequest], folder: Path) -> Path:
        router = make_router(engine.router, engine.block_size, prices)
        write_real(replay_fleet_records(engine, requests, vocab, router), engine,
                   folder / "real", desc)
        return folder / "real"  # (as replay's)
    return run


def _engine_of(config: dict[str, Any], model: Any) -> Any:
    from twinserve.core.engine_args import EngineArgs
    engine = {k: v for k, v in config.items() if k not in ("hardware", "model", *PD_KEYS)}
    return EngineArgs.from_mapping(engine, "best configuration", model=model)
