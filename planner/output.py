"""What a plan writes: ``plan.csv`` (every configuration), ``front.csv`` (the Pareto fronts),
``best.yaml`` (the recommendation as ``--config`` keys), and the top-N table it prints.

``best.yaml`` holds the keys both ``twinserve simulate --config`` and ``twinserve serve --config``
accept: the model, the hardware profile, the replicas as ``data_parallel_size`` and the router (or,
disaggregated, ``prefill_instances``, ``decode_instances`` and each pool's overrides as
``prefill_args``/``decode_args``), and every engine argument with the value the twin resolved for
that hardware (so a server on another device starts with the batch
limits the plan simulated, not its own defaults). Its comment lines carry the predicted capacity
and the equivalent vLLM command lines. A P/D deployment's link is a key (``kv_link``) only where
the plan chose one other than the profile's own (InfiniBand across nodes, or named): ``simulate``
needs it to reproduce the plan, and ``serve``, which moves KV over the machine it runs on, has no
such flag (drop the line there).
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from twinserve.planner.pareto import pareto_mask
from twinserve.planner.plan import FITTED, PlanResult
from twinserve.planner.space import PD_KEYS, POOL_VARIED, POOLS
from twinserve.planner.spec import PlanSpec
from twinserve.simulator.run import SimConfig, build_engine_config

# (name, x, y, maximize x, maximize y)
FRONTS = (("throughput", "output_tokens_per_s_per_gpu", "output_tokens_per_s_per_user", True, True),
          ("cost-latency", "cost_per_m_output_tokens", "p90_ttft_ms", False, False))
# the resolved values of these come from the engine configuration the twin built
RESOLVED_KEYS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting_requests",
                 "max_waiting_tokens")
VLLM_POLICIES = ("fcfs", "priority")
# vLLM's P/D: separate `vllm serve` instances with a KV connector (its NixlConnector guide runs
# both roles as kv_both), and a proxy in front
VLLM_PD_TRANSFER = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
VLLM_PD_PORTS = {"prefill": 8100, "decode": 8200}
TOP_COLUMNS = ("name", "gpus", "capacity_rps", "cost_per_m_output_tokens",
               "output_tokens_per_s_per_gpu", "output_tokens_per_s_per_user", "p90_ttft_ms",
               "capacity_per_dollar_hour")


def plan_table(result: PlanResult) -> pd.DataFrame:
    return pd.DataFrame(result.rows)


def front_table(result: PlanResult) -> pd.DataFrame:
    """One row per configuration on each front: the front's name, its two values, the settings."""
    fitted = result.fitted()
    rows = []
    for name, x, y, max_x, max_y in FRONTS:
        mask = pareto_mask([(float(r[x]), float(r[y])) for r in fitted], (max_x, max_y))
        on = sorted((r for r, keep in zip(fitted, mask) if keep), key=lambda r: r[x])
        rows += [{"front": name, "x": x, "x_value": r[x], "y": y, "y_value": r[y], **r} for r in on]
    return pd.DataFrame(rows)


def best_config(row: dict[str, Any], spec: PlanSpec) -> dict[str, Any]:
    """The recommended configuration as ``--config`` keys (dashes in vLLM's style)."""
    sim = SimConfig.from_flat(_sim_of(row, spec))
    resolved = build_engine_config(sim).engine_config
    scheduler = asdict(resolved.scheduler)
    args = {k: v for k, v in asdict(sim.engine).items() if k != "model"}
    args.update({k: scheduler[k] for k in RESOLVED_KEYS if k in scheduler})
    args["max_model_len"] = resolved.max_model_len
    if sim.disaggregated:
        args.update(prefill_instances=sim.prefill_instances, decode_instances=sim.decode_instances,
                    kv_link=sim.kv_link, prefill_args=sim.prefill_args, decode_args=sim.decode_args)
    else:
        args["data_parallel_size"] = sim.num_replicas
        args["router"] = sim.router
    keep = {k: v for k, v in args.items() if v is not None and v != {}}
    return {"model": sim.model, "hardware": row["hardware"], **keep}


def _sim_of(row: dict[str, Any], spec: PlanSpec) -> dict[str, Any]:
    keys = ("hardware", "tensor_parallel_size", "pipeline_parallel_size", "num_replicas", "router",
            "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "scheduling_policy",
            "quantization")
    sim = {k: row[k] for k in keys if _given(row.get(k))}
    if _given(row.get("prefill_instances")) and row["prefill_instances"] > 0:
        sim.update({k: row[k] for k in PD_KEYS if _given(row.get(k))})
        for pool in POOLS:
            given = {arg: int(row[f"{pool}_{arg}"]) for arg in POOL_VARIED
                     if _given(row.get(f"{pool}_{arg}"))}
            if given:
                sim[f"{pool}_args"] = given
    if _given(row.get("speculative_config")):
        sim["speculative_config"] = json.loads(row["speculative_config"])
    return {**spec.space.fixed, "model": spec.space.model, **sim}


def _shape(config: dict[str, Any]) -> str:
    if "prefill_instances" not in config:
        return ""
    return f" as {config['prefill_instances']}P{config['decode_instances']}D"


def _given(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def vllm_command(config: dict[str, Any]) -> str:
    """The ``vllm serve`` line for the same engine (vLLM's flags; twinserve-only ones left out)."""
    parts = ["vllm", "serve", str(config["model"])]
    flags = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "max_num_seqs",
             "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization", "block_size",
             "quantization", "kv_cache_dtype")
    for key in flags:
        if config.get(key) is not None:
            parts += [f"--{key.replace('_', '-')}", str(config[key])]
    for key in ("enable_chunked_prefill", "enable_prefix_caching"):
        if key in config:
            parts.append(f"--{'' if config[key] else 'no-'}{key.replace('_', '-')}")
    if config.get("scheduling_policy") in VLLM_POLICIES:
        parts += ["--scheduling-policy", config["scheduling_policy"]]
    if config.get("speculative_config"):
        parts += ["--speculative-config", json.dumps(config["speculative_config"], sort_keys=True)]
    return shlex.join(parts)


def vllm_pd_commands(config: dict[str, Any]) -> list[str]:
    """The ``vllm serve`` lines of an xPyD deployment: one per pool (each instance of a pool
    runs its line, on its own GPUs and port, with its pool's arguments), with vLLM's KV
    transfer configuration."""
    transfer = json.dumps(VLLM_PD_TRANSFER, sort_keys=True)
    return [f"{pool} x{config[f'{pool}_instances']}: "
            f"{vllm_command({**config, **(config.get(f'{pool}_args') or {})})} --port {port} "
            f"--kv-transfer-config {shlex.quote(transfer)}" for pool, port in VLLM_PD_PORTS.items()]


def _vllm_notes(config: dict[str, Any]) -> list[str]:
    if "prefill_instances" not in config:
        notes = [f"vLLM: {vllm_command(config)}"]
        if config.get("data_parallel_size", 1) > 1:
            notes.append(f"vLLM: {config['data_parallel_size']} replicas behind a "
                         f"{config['router']} router in front")
        return notes
    return [*(f"vLLM {line}" for line in vllm_pd_commands(config)),
            "vLLM: a proxy in front sends each request to a prefill instance (max_tokens 1), then "
            "with its kv_transfer_params to a decode instance (vLLM's disaggregated "
            "toy_proxy_server.py --prefiller-hosts/--decoder-hosts, or twinserve pd-proxy)"]


def write_best(row: dict[str, Any], spec: PlanSpec, path: Path) -> dict[str, Any]:
    config = best_config(row, spec)
    slos = ", ".join(f"{s.key}={s.limit_ms:g}" for s in spec.slos)
    bounded = " (a lower bound: it passed at the highest rate searched)" \
        if row.get("capacity_lower_bound") else ""
    notes = [f"capacity_rps: {row['capacity_rps']:.4g}{bounded}",
             f"the cheapest configuration meeting {slos} (attainment as planned)"
             f" at {row['capacity_rps']:.4g} req/s: ${row['cost_per_m_output_tokens']:.4g} per million "
             f"output tokens, {row['gpus']} x {row['hardware']}{_shape(config)}",
             "twinserve simulate --config best.yaml --trace T  |  twinserve serve --config best.yaml "
             "--model YOUR_CHECKPOINT",
             *_vllm_notes(config)]
    if config.get("scheduling_policy") not in VLLM_POLICIES:
        notes.append(f"vLLM has no {config.get('scheduling_policy')!r} scheduling policy")
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
    path.write_text("".join(f"# {n}\n" for n in notes) + body, encoding="utf-8")
    return config


def write_outputs(result: PlanResult, spec: PlanSpec, out: Path) -> dict[str, Path]:
    """plan.csv, front.csv and (when a configuration meets the SLOs) best.yaml."""
    paths = {"plan": out / "plan.csv", "front": out / "front.csv"}
    plan_table(result).to_csv(paths["plan"], index=False)
    front_table(result).to_csv(paths["front"], index=False)
    if result.best is not None:
        paths["best"] = out / "best.yaml"
        write_best(result.best, spec, paths["best"])
    return paths


def top_table(result: PlanResult, n: int = 10) -> str:
    """The ``n`` best configurations (the cheapest per output token first), as text; a capacity
    the search could only bound from below is shown as ``>=`` and explained under the table."""
    fitted = [r for r in result.rows if r["status"] == FITTED][:n]
    if not fitted:
        return "no configuration meets the SLOs."
    frame = pd.DataFrame([{k: capacity_text(r) if k == "capacity_rps" else r[k]
                           for k in TOP_COLUMNS} for r in fitted])
    frame.index = range(1, len(frame) + 1)
    note = lower_bound_note(fitted, result.stats.get("requests_per_replay"))
    table = frame.to_string(float_format=lambda v: f"{v:.4g}")
    return table if note is None else f"{table}\n{note}"


def capacity_text(row: dict[str, Any]) -> str:
    """A fitted row's capacity, ``>=`` where it is a lower bound."""
    return (">= " if row.get("capacity_lower_bound") else "") + f"{row['capacity_rps']:.4g}"


def lower_bound_note(rows: list[dict[str, Any]], num_requests: int | None) -> str | None:
    """What a reader must know when some of ``rows`` passed at the highest rate searched: their
    capacities (and so their costs and their order) are bounds, not found (None: none did)."""
    bounded = [r for r in rows if r.get("capacity_lower_bound")]
    if not bounded:
        return None
    held = f"the most {num_requests} requests hold over duration_s" if num_requests else \
        "the most the trace holds over duration_s"
    return (f"capacity >= {bounded[0]['capacity_rps']:.4g} req/s: {len(bounded)} of these "
            f"{len(rows)} pass at the highest rate searched (search.max_rps, or {held}), so "
            "their capacities and costs are bounds and their order is not decided; take more "
            "requests (--num-requests), a shorter --duration or a higher --max-rps to place them.")
