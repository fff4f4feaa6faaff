"""The configuration space a plan searches, and the memory check that prunes it before simulating.

A candidate is one deployment: a GPU type, the tensor- and pipeline-parallel sizes of one replica,
how many replicas and the router in front of them, and the engine arguments that vary (batch
limits, chunked prefill, scheduling policy, speculation, quantization). The space is the cartesian
product of the axes, less what cannot be: TP beyond one node, more stages than layers, more GPUs
than ``max_gpus``, a router choice for a single replica, a token budget without chunked prefill
(vLLM raises it to ``max_model_len`` there, so the values would repeat one configuration).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.policies import available_policies
from twinserve.routers import available_routers
from twinserve.simulator.cost_model import CostModel
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.run import SimConfig, build_engine_config

SINGLE_REPLICA_ROUTER = "round-robin"
QUANTIZATIONS = (None, "fp8", "int8")  # what the twin prices without a quantized checkpoint
# The engine arguments a plan varies (besides tensor_parallel_size and pipeline_parallel_size).
VARIED = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "scheduling_policy",
          "speculative_config", "quantization")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One deployment; ``engine``: the varied engine arguments as sorted (key, value) pairs
    (``None``: the engine's default)."""

    hardware: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_replicas: int
    router: str
    engine: tuple[tuple[str, Any], ...]

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.num_replicas

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def settings(self) -> dict[str, Any]:
        """The candidate's axes, flat (as plan.csv's columns)."""
        return {"hardware": self.hardware, "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                "num_replicas": self.num_replicas, "router": self.router, **dict(self.engine)}

    @property
    def replica_key(self) -> tuple[Any, ...]:
        """What one replica's engine is made of: hardware and varied engine arguments (the
        dominance bound compares candidates of one key)."""
        return (self.hardware, self.engine)

    @property
    def name(self) -> str:
        parts = [self.hardware, f"tp{self.tensor_parallel_size}", f"pp{self.pipeline_parallel_size}",
                 f"x{self.num_replicas}"]
        if self.num_replicas > 1:
            parts.append(self.router)
        parts += [f"{k}={_short(v)}" for k, v in self.engine if v is not None]
        return " ".join(parts)

    @property
    def candidate_id(self) -> str:
        blob = json.dumps(self.settings, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    @property
    def folder(self) -> str:
        return f"{re.sub(r'[^A-Za-z0-9.=-]+', '_', self.name)[:120]}-{self.candidate_id}"

    def sim(self, model: str, fixed: dict[str, Any]) -> dict[str, Any]:
        """The flat SimConfig mapping (``SimConfig.from_flat``) of this candidate."""
        engine = {k: v for k, v in self.engine if v is not None}
        return {**fixed, "model": model, "hardware": self.hardware,
                "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                "num_replicas": self.num_replicas, "router": self.router, **engine}


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("method", "spec"))
    return str(value)


@dataclass(frozen=True, slots=True)
class PlanSpace:
    """The axes of a plan. ``replicas`` ``()``: every count that fits ``max_gpus``."""

    model: str
    hardware: tuple[str, ...]
    max_gpus: int
    tensor_parallel_sizes: tuple[int, ...] = (1, 2, 4, 8)
    pipeline_parallel_sizes: tuple[int, ...] = (1, 2)
    replicas: tuple[int, ...] = ()
    routers: tuple[str, ...] = ("round-robin", "cache-aware")
    max_num_seqs: tuple[int, ...] = (128, 256)
    max_num_batched_tokens: tuple[int, ...] = (2048, 8192)
    enable_chunked_prefill: tuple[bool, ...] = (True,)
    scheduling_policies: tuple[str, ...] = ("fcfs",)
    speculative_configs: tuple[dict[str, Any] | None, ...] = (None,)
    quantizations: tuple[str | None, ...] = (None,)
    gpus_per_node: int = 8
    fixed: dict[str, Any] = field(default_factory=dict)  # engine arguments every candidate shares
    # ---- disaggregated prefill/decode: the twin does not run it yet (another change adds
    # --prefill-instances/--decode-instances to it). When it lands, these become an axis of
    # (prefill, decode) instance counts in ``candidates`` and Candidate gains the two fields.
    prefill_instances: tuple[int, ...] = ()
    decode_instances: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        load_model_spec(self.model)  # ValueError naming an unknown model
        if self.prefill_instances or self.decode_instances:
            raise ValueError("prefill_instances/decode_instances: disaggregated prefill and decode "
                             "is not in the twin yet, so a plan cannot search it.")
        if not self.hardware:
            raise ValueError("hardware: at least one hardware profile is needed.")
        _positive_int("max_gpus", self.max_gpus)
        _positive_int("gpus_per_node", self.gpus_per_node)
        for name in ("tensor_parallel_sizes", "pipeline_parallel_sizes", "replicas",
                     "max_num_seqs", "max_num_batched_tokens"):
            for value in getattr(self, name):
                _positive_int(name, value)
        for name in ("tensor_parallel_sizes", "pipeline_parallel_sizes", "routers", "max_num_seqs",
                     "max_num_batched_tokens", "enable_chunked_prefill", "scheduling_policies",
                     "speculative_configs", "quantizations"):
            if not getattr(self, name):
                raise ValueError(f"{name}: at least one value is needed.")
        _known("routers", self.routers, available_routers())
        _known("scheduling_policies", self.scheduling_policies, available_policies())
        _known("quantizations", self.quantizations, QUANTIZATIONS)
        for value in self.enable_chunked_prefill:
            if not isinstance(value, bool):
                raise ValueError(f"enable_chunked_prefill: expected true or false, got {value!r}.")
        unknown = [k for k in self.fixed if k not in EngineArgs.field_names() or k in VARIED
                   or k in ("model", "tensor_parallel_size", "pipeline_parallel_size")]
        if unknown:
            raise ValueError(f"fixed engine arguments: {', '.join(unknown)} are not engine "
                             "arguments, or are axes of the plan.")
        for spec in self.speculative_configs:  # ValueError naming the bad key
            EngineArgs(speculative_config=spec)

    def candidates(self) -> Iterator[Candidate]:
        num_layers = load_model_spec(self.model).num_hidden_layers
        for hardware, tp, pp in itertools.product(self.hardware, self.tensor_parallel_sizes,
                                                  self.pipeline_parallel_sizes):
            if tp > self.gpus_per_node or pp > num_layers or tp * pp > self.max_gpus:
                continue
            for replicas in self._replica_counts(tp * pp):
                routers = self.routers if replicas > 1 else (SINGLE_REPLICA_ROUTER,)
                for router, engine in itertools.product(routers, self._engine_settings()):
                    yield Candidate(hardware, tp, pp, replicas, router, engine)

    def _replica_counts(self, per_replica: int) -> list[int]:
        fit = self.max_gpus // per_replica
        return [r for r in self.replicas if r <= fit] if self.replicas else list(range(1, fit + 1))

    def _engine_settings(self) -> Iterator[tuple[tuple[str, Any], ...]]:
        seen: set[str] = set()
        for seqs, tokens, chunked, policy, spec, quant in itertools.product(
                self.max_num_seqs, self.max_num_batched_tokens, self.enable_chunked_prefill,
                self.scheduling_policies, self.speculative_configs, self.quantizations):
            values = {"enable_chunked_prefill": chunked, "max_num_batched_tokens":
                      tokens if chunked else None, "max_num_seqs": seqs, "quantization": quant,
                      "scheduling_policy": policy, "speculative_config": spec}
            key = json.dumps(values, sort_keys=True)
            if key not in seen:
                seen.add(key)
                yield tuple(sorted(values.items()))


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}.")


def _known(name: str, values: tuple[Any, ...], valid: Any) -> None:
    for value in values:
        if value not in valid:
            raise ValueError(f"{name}: unknown value {value!r}; valid: "
                             f"{', '.join(str(v) for v in valid)}.")


@dataclass(frozen=True, slots=True)
class Sizing:
    """A candidate as the twin sizes it: why it cannot serve the workload ("" when it can) and
    what its step times rest on (``roofline``, or ``fitted`` to measurements)."""

    reason: str
    cost_basis: str


def size_candidate(candidate: Candidate, model: str, fixed: dict[str, Any],
                   longest_request: int) -> Sizing:
    """One replica must hold the weights and the KV cache of at least one request of
    ``longest_request`` tokens (prompt and output), as the twin sizes them
    (``simulator.run.build_engine_config``, vLLM's memory accounting: per-GPU weights at this TP,
    activations, ``gpu_memory_utilization``)."""
    try:
        build = build_engine_config(SimConfig.from_flat(candidate.sim(model, fixed)))
    except ValueError as exc:
        return Sizing(str(exc), "")
    basis = "roofline" if isinstance(build.cost_model, CostModel) else "fitted"
    kv_tokens = build.engine_config.scheduler.num_gpu_blocks * candidate_block_size(fixed)
    if kv_tokens < longest_request:
        return Sizing(f"the KV cache holds {kv_tokens} tokens per replica, less than the longest "
                      f"request's {longest_request}.", basis)
    return Sizing("", basis)


def memory_verdict(candidate: Candidate, model: str, fixed: dict[str, Any],
                   longest_request: int) -> str:
    """Why ``candidate`` cannot serve the workload ("" when it can): ``size_candidate``'s reason."""
    return size_candidate(candidate, model, fixed, longest_request).reason


def candidate_block_size(fixed: dict[str, Any]) -> int:
    return int(fixed.get("block_size") or EngineArgs().block_size)
