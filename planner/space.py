"""The configuration space a plan searches, and the memory check that prunes it before simulating.

A candidate is one deployment: a GPU type, the tensor- and pipeline-parallel sizes of one engine,
either aggregated (how many replicas and the router in front of them) or disaggregated (xPyD: x
prefill and y decode instances of that engine, KV moved over a link), and the engine arguments
that vary (batch limits, chunked prefill, scheduling policy, speculation, quantization). The space
is the cartesian product of the axes, less what cannot be: TP beyond one node, more stages than
layers, more GPUs than ``max_gpus``, a router choice for a single replica, a token budget without
chunked prefill (vLLM raises it to ``max_model_len`` there, so the values would repeat one
configuration), and what the twin's P/D fleet does not run (pipeline parallelism, speculation).

Per-pool axes (``prefill_max_num_seqs``, ``decode_max_num_batched_tokens``, ...; AIConfigurator
and DistServe size each pool for its phase) apply to xPyD deployments only, as the pool's
overrides (``core/pool_args.py``: ``prefill_args``/``decode_args``) of the deployment's engine
arguments; ``None`` is the deployment's own value. An override equal to that value, or a token
budget without chunked prefill, is no override, so no configuration is searched twice.

The KV link of an xPyD deployment (``kv_links`` ``auto``): the profile's own (its measured link,
else NVLink: ``HardwareProfile.kv_link_spec``) when all its GPUs fit one node, else InfiniBand.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.policies import available_policies
from twinserve.routers import available_routers
from twinserve.simulator.cost_model import CostModel
from twinserve.simulator.kv_transfer import LINK_NAMES
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.run import EngineBuild, SimConfig, build_engine_config

SINGLE_REPLICA_ROUTER = "round-robin"
QUANTIZATIONS = (None, "fp8", "int8")  # what the twin prices without a quantized checkpoint
# The engine arguments a plan varies (besides tensor_parallel_size and pipeline_parallel_size).
VARIED = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "scheduling_policy",
          "speculative_config", "quantization")
AGGREGATED = "off"  # the disaggregation axis's aggregated value
AUTO_LINK = "auto"  # the kv_links axis's default (module docstring)
CROSS_NODE_LINK = "infiniband"
PD_KEYS = ("prefill_instances", "decode_instances", "kv_link")  # plan.csv's P/D columns
# what the twin's P/D fleet refuses (simulator.run._simulate_disaggregated) among fixed arguments
PD_REFUSED_FIXED = ("enable_lora", "kv_offloading_size")
_SHAPE = re.compile(r"(\d+)P(\d+)D")
POOLS = ("prefill", "decode")
POOL_VARIED = ("max_num_seqs", "max_num_batched_tokens")  # what a pool axis may override
POOL_COLUMNS = tuple(f"{pool}_{arg}" for pool in POOLS for arg in POOL_VARIED)  # plan.csv's
PoolArgs = tuple[tuple[str, Any], ...]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One deployment; ``engine``: the varied engine arguments as sorted (key, value) pairs
    (``None``: the engine's default). ``prefill_instances``/``decode_instances`` (xPyD, both
    >= 1; 0 and 0: aggregated) run one engine each of ``gpus_per_replica`` GPUs, behind the
    twin's P/D router (``num_replicas`` 1); ``kv_link``: their link (None: the profile's own);
    ``prefill_args``/``decode_args``: each pool's overrides as sorted (key, value) pairs."""

    hardware: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_replicas: int
    router: str
    engine: tuple[tuple[str, Any], ...]
    prefill_instances: int = 0
    decode_instances: int = 0
    kv_link: str | None = None
    prefill_args: PoolArgs = ()
    decode_args: PoolArgs = ()

    @property
    def disaggregated(self) -> bool:
        return self.prefill_instances > 0

    @property
    def instances(self) -> int:
        """Engines of the deployment: replicas, or prefill and decode instances."""
        if self.disaggregated:
            return self.prefill_instances + self.decode_instances
        return self.num_replicas

    @property
    def gpus(self) -> int:
        return self.gpus_per_replica * self.instances

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def settings(self) -> dict[str, Any]:
        """The candidate's axes, flat (as plan.csv's columns)."""
        return {"hardware": self.hardware, "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                "num_replicas": self.num_replicas, "router": self.router, **dict(self.engine),
                "prefill_instances": self.prefill_instances,
                "decode_instances": self.decode_instances, "kv_link": self.kv_link,
                **self.pool_columns}

    @property
    def pool_columns(self) -> dict[str, Any]:
        """Each pool axis's value (None: the deployment's own), as plan.csv's columns."""
        given = {pool: dict(getattr(self, f"{pool}_args")) for pool in POOLS}
        return {f"{pool}_{arg}": given[pool].get(arg) for pool in POOLS for arg in POOL_VARIED}

    @property
    def replica_key(self) -> tuple[Any, ...]:
        """What one engine is made of (hardware, varied engine arguments) and, for xPyD, the
        deployment's shape: the ratio x:y in lowest terms and the link. The dominance bound
        compares candidates of one key only, so an xPyD deployment is bounded by smaller ones
        of the same ratio (1P1D by nothing, 2P2D by 1P1D), never by aggregated replicas, nor
        they by it: a P/D split can raise throughput per GPU well beyond the slack (DistServe),
        while a same-ratio multiple is the replicas' case (pools that grow together)."""
        if not self.disaggregated:
            return (self.hardware, self.engine)
        g = math.gcd(self.prefill_instances, self.decode_instances)
        return (self.hardware, self.engine,
                (self.prefill_instances // g, self.decode_instances // g), self.kv_link,
                self.prefill_args, self.decode_args)

    @property
    def name(self) -> str:
        parts = [self.hardware, f"tp{self.tensor_parallel_size}", f"pp{self.pipeline_parallel_size}"]
        if self.disaggregated:
            parts.append(f"{self.prefill_instances}P{self.decode_instances}D")
            if self.kv_link is not None:
                parts.append(self.kv_link)
        else:
            parts.append(f"x{self.num_replicas}")
        if self.num_replicas > 1:
            parts.append(self.router)
        parts += [f"{k}={_short(v)}" for k, v in self.engine if v is not None]
        parts += [f"{pool}.{k}={v}" for pool in POOLS for k, v in getattr(self, f"{pool}_args")]
        return " ".join(parts)

    @property
    def candidate_id(self) -> str:
        settings = self.settings
        if not self.disaggregated:  # an aggregated id stays what it was before the P/D axis
            for key in PD_KEYS:
                del settings[key]
        for key in POOL_COLUMNS:  # and an xPyD one without overrides what it was before them
            if settings[key] is None:
                del settings[key]
        blob = json.dumps(settings, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    @property
    def folder(self) -> str:
        return f"{re.sub(r'[^A-Za-z0-9.=-]+', '_', self.name)[:120]}-{self.candidate_id}"

    def sim(self, model: str, fixed: dict[str, Any]) -> dict[str, Any]:
        """The flat SimConfig mapping (``SimConfig.from_flat``) of this candidate."""
        engine = {k: v for k, v in self.engine if v is not None}
        pd: dict[str, Any] = ({"prefill_instances": self.prefill_instances, "decode_instances":
               self.decode_instances, "kv_link": self.kv_link} if self.disaggregated else {})
        pd.update({f"{pool}_args": dict(getattr(self, f"{pool}_args")) for pool in POOLS
                   if getattr(self, f"{pool}_args")})
        return {**fixed, "model": model, "hardware": self.hardware,
                "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                "num_replicas": self.num_replicas, "router": self.router, **engine, **pd}


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
    # aggregated ("off") and/or xPyD shapes ("1P1D", "2P1D"); max_pd_instances adds every xPyD
    # with x + y <= it. kv_links: the links xPyD deployments are tried on (AUTO_LINK: see above).
    disaggregation: tuple[str, ...] = (AGGREGATED,)
    max_pd_instances: int | None = None
    kv_links: tuple[str, ...] = (AUTO_LINK,)
    # each pool's batch limits (xPyD only; None: the deployment's own)
    prefill_max_num_seqs: tuple[int | None, ...] = (None,)
    prefill_max_num_batched_tokens: tuple[int | None, ...] = (None,)
    decode_max_num_seqs: tuple[int | None, ...] = (None,)
    decode_max_num_batched_tokens: tuple[int | None, ...] = (None,)

    def __post_init__(self) -> None:
        load_model_spec(self.model)  # ValueError naming an unknown model
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
                     "speculative_configs", "quantizations", "disaggregation", "kv_links"):
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
        self._check_disaggregation()

    def _check_disaggregation(self) -> None:
        for value in self.disaggregation:
            if value != AGGREGATED and not (isinstance(value, str) and _SHAPE.fullmatch(value)
                                            and min(pd_shape(value)) >= 1):
                raise ValueError(f"disaggregation: expected {AGGREGATED!r} or xPyD with x, y >= 1 "
                                 f"(e.g. 1P1D, 2P1D), got {value!r}.")
        if self.max_pd_instances is not None:
            _positive_int("max_pd_instances", self.max_pd_instances)
            if self.max_pd_instances < 2:
                raise ValueError(f"max_pd_instances: xPyD needs x + y >= 2 instances, got "
                                 f"{self.max_pd_instances!r}.")
        _known("kv_links", self.kv_links, (AUTO_LINK, *LINK_NAMES, "measured"))
        for name in POOL_COLUMNS:
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{name}: at least one value is needed.")
            for value in values:
                if value is not None:
                    _positive_int(name, value)
        if self.pd_shapes:
            refused = [k for k in PD_REFUSED_FIXED if self.fixed.get(k)]
            if refused:
                raise ValueError(f"fixed engine arguments: {', '.join(refused)} cannot run with "
                                 "disaggregated prefill/decode in the twin yet.")

    @property
    def pd_shapes(self) -> list[tuple[int, int]]:
        """The xPyD shapes searched: the axis's and those ``max_pd_instances`` generates."""
        shapes = [pd_shape(v) for v in self.disaggregation if v != AGGREGATED]
        if self.max_pd_instances is not None:
            shapes += [(x, n - x) for n in range(2, self.max_pd_instances + 1) for x in range(1, n)]
        return list(dict.fromkeys(shapes))

    def candidates(self) -> Iterator[Candidate]:
        num_layers = load_model_spec(self.model).num_hidden_layers
        for hardware, tp, pp in itertools.product(self.hardware, self.tensor_parallel_sizes,
                                                  self.pipeline_parallel_sizes):
            if tp > self.gpus_per_node or pp > num_layers or tp * pp > self.max_gpus:
                continue
            if AGGREGATED in self.disaggregation:
                for replicas in self._replica_counts(tp * pp):
                    routers = self.routers if replicas > 1 else (SINGLE_REPLICA_ROUTER,)
                    for router, engine in itertools.product(routers, self._engine_settings()):
                        yield Candidate(hardware, tp, pp, replicas, router, engine)
            if pp == 1:  # the twin's P/D fleet runs one stage per instance
                yield from self._disaggregated(hardware, tp)

    def _disaggregated(self, hardware: str, tp: int) -> Iterator[Candidate]:
        for x, y in self.pd_shapes:
            if (x + y) * tp > self.max_gpus:
                continue
            one_node = (x + y) * tp <= self.gpus_per_node
            links = dict.fromkeys((None if one_node else CROSS_NODE_LINK) if link == AUTO_LINK
                                  else link for link in self.kv_links)
            for link, engine in itertools.product(links, self._engine_settings()):
                if dict(engine)["speculative_config"] is None:  # the P/D fleet has no drafts
                    for pre, dec in self._pool_settings(dict(engine)):
                        yield Candidate(hardware, tp, 1, 1, SINGLE_REPLICA_ROUTER, engine, x, y,
                                        link, pre, dec)

    def _pool_settings(self, engine: dict[str, Any]) -> list[tuple[PoolArgs, PoolArgs]]:
        """Each pool's overrides of ``engine`` (module docstring), without repeats."""
        per_pool: list[list[tuple[tuple[str, Any], ...]]] = []
        for pool in POOLS:
            options: list[tuple[tuple[str, Any], ...]] = []
            for values in itertools.product(*(getattr(self, f"{pool}_{a}") for a in POOL_VARIED)):
                given = dict(zip(POOL_VARIED, values))
                if not engine["enable_chunked_prefill"]:
                    given["max_num_batched_tokens"] = None
                options.append(tuple(sorted((k, v) for k, v in given.items()
                                            if v is not None and v != engine[k])))
            per_pool.append(list(dict.fromkeys(options)))
        prefill, decode = per_pool
        return list(itertools.product(prefill, decode))

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


def pd_shape(text: str) -> tuple[int, int]:
    """``"2P1D"`` -> (2, 1)."""
    match = _SHAPE.fullmatch(text)
    if match is None:
        raise ValueError(f"disaggregation: expected xPyD (e.g. 1P1D), got {text!r}.")
    return int(match[1]), int(match[2])


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
                   longest_request: int, longest_prompt: int = 0) -> Sizing:
    """Each engine must hold the weights and the KV cache of the longest request it serves, as
    the twin sizes them (``simulator.run.build_engine_config``, vLLM's memory accounting:
    per-GPU weights at this TP, activations for its batch limits, ``gpu_memory_utilization``):
    a replica or a decode instance its prompt and output (``longest_request`` tokens), a
    prefill instance its prompt and the one token it samples, each pool with its own
    overrides. An xPyD deployment's link must exist for its hardware."""
    try:
        cfg = SimConfig.from_flat(candidate.sim(model, fixed))
        builds = _pool_builds(cfg)
        if candidate.disaggregated:
            builds["decode instance"].cost_model.hardware.kv_link_spec(candidate.kv_link)
    except ValueError as exc:
        return Sizing(str(exc), "")
    first = next(iter(builds.values()))
    basis = "roofline" if isinstance(first.cost_model, CostModel) else "fitted"
    needs = ({"prefill instance": longest_prompt + 1, "decode instance": longest_request}
             if candidate.disaggregated else {"replica": longest_request})
    for pool, tokens in needs.items():
        kv_tokens = builds[pool].engine_config.scheduler.num_gpu_blocks * candidate_block_size(fixed)
        if kv_tokens < tokens:
            return Sizing(f"the KV cache holds {kv_tokens} tokens per {pool}, less than the "
                          f"longest request's {tokens}.", basis)
    return Sizing("", basis)


def _pool_builds(cfg: SimConfig) -> dict[str, EngineBuild]:
    """One engine of each kind the deployment runs: a replica, or a prefill and a decode
    instance with their pools' arguments (as the twin's P/D fleet builds them); a pool's
    engine that cannot be built raises ValueError naming the pool."""
    build = build_engine_config(cfg)
    if not cfg.disaggregated:
        return {"replica": build}
    builds = {}
    for pool in POOLS:
        if not getattr(cfg, f"{pool}_args"):
            builds[f"{pool} instance"] = build
            continue
        try:
            builds[f"{pool} instance"] = build_engine_config(SimConfig(
                cfg.pool_engine(pool), hardware=cfg.hardware, usage_context=cfg.usage_context))
        except ValueError as exc:
            raise ValueError(f"{pool}_args: {exc}") from None
    return builds


def memory_verdict(candidate: Candidate, model: str, fixed: dict[str, Any],
                   longest_request: int, longest_prompt: int = 0) -> str:
    """Why ``candidate`` cannot serve the workload ("" when it can): ``size_candidate``'s reason."""
    return size_candidate(candidate, model, fixed, longest_request, longest_prompt).reason


def candidate_block_size(fixed: dict[str, Any]) -> int:
    return int(fixed.get("block_size") or EngineArgs().block_size)
