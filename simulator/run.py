"""One simulation run: build the replicas from a config, replay a trace, summarise, write a run folder."""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import simpy

from twinserve.core.config import SchedulerConfig
from twinserve.core.engine_args import EngineArgs
from twinserve.core.engine_config import USAGE_CONTEXTS, EngineConfig, resolve_engine_config
from twinserve.core.kernel_settings import kernel_settings_mismatch
from twinserve.core.kv_offload import OFFLOADING_CONNECTOR, OffloadingConnectorScheduler
from twinserve.core.metrics import RequestRecord, StepLog, kv_offload_summary, summarize
from twinserve.core.model_config import ModelConfig
from twinserve.core.policy import SchedulingPolicy
from twinserve.core.pool_args import check_pool_args, pool_engine_args
from twinserve.core.request import LazyPrompt, RepeatedTokenIds, Request
from twinserve.core.run_dir import DisaggregatedParts, write_run
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import Scheduler
from twinserve.core.step_driver import RunRecorder, StepDriver
from twinserve.policies import get_policy
from twinserve.policies.speculation import speculation_policy_for
from twinserve.routers import Router, make_router, reads_loads, router_class, uses_kv_events
from twinserve.simulator.acceptance import AcceptanceModel, AcceptanceProfile
from twinserve.simulator.cost_model import (
    CostModel,
    DeviceCostModel,
    FittedCostModel,
    make_cost_model,
)
from twinserve.simulator.engine import (
    SIMULATED_TOKEN,
    ArrivalHorizons,
    Replica,
    SyntheticTokens,
    arrival_process,
    engine_process,
)
from twinserve.simulator.fleet_apart import run_apart
from twinserve.simulator.hardware import HardwareProfile, load_hardware
from twinserve.simulator.lora_run import LoadTally, lora_cost_for, lora_summary
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.roofline_gap import roofline_caveat
from twinserve.simulator.router_prices import router_prices
from twinserve.simulator.step_time import StepTimeModel
from twinserve.simulator.structured_cost import StructuredWorkload, structured_cost_of
from twinserve.traces import LoRAAdapters, TraceRequest
from twinserve.traces.trace_request import (
    PromptParts,
    iter_prompt_parts,
    iter_prompt_token_ids,
    prompt_ids_slice,
)

if TYPE_CHECKING:  # (loaded where a run needs them: a host KV tier, pipeline stages)
    from twinserve.simulator.kv_offload import TwinOffloadingWorker
    from twinserve.simulator.pipeline import PipelineCost

_arrival_time = attrgetter("arrival_time")

# The default twin stands on measured ground: Llama-3-8B on an A100-80GB, the GPU most
# published serving studies ran on (Vidur, DistServe, Sarathi) and the one a newcomer most likely
# rents. Its fit rests on Vidur's per-operator measurements of that model (vLLM-class kernels,
# attention measured at TP 1; linear operators and all-reduces at TP 2-8), so the default run
# predicts a production-class engine. The H200 fit measures twinserve's own engine (eager
# prefill steps) at TP 1 only: a prediction of twinserve on an H200, not the usual first question.
# H100 has no Llama-3-8B measurement: it runs on the roofline (``roofline_gap``).
DEFAULT_SIM_MODEL = "llama-3-8b"
DEFAULT_SIM_HARDWARE = "a100-80gb"
SIM_KEYS = ("hardware", "usage_context", "num_replicas", "router", "label")
# A disaggregated fleet's keys: recorded (flat(), config.json) only when it is one, so the files
# of aggregated runs stay as they were.
PD_KEYS = ("prefill_instances", "decode_instances", "kv_link", "prefill_args", "decode_args")


@dataclass(slots=True, init=False)
class SimConfig:
    """What to simulate: the engine's arguments (``core.engine_args.EngineArgs``, the same the
    real engine takes, resolved by the same function), the hardware profile the twin stands
    for, the usage context whose defaults apply (a trace replay is a server's workload) and the
    replicas. Engine arguments may be given flat: ``SimConfig(max_num_seqs=64, hardware="a100")``.
    """

    engine: EngineArgs
    hardware: str
    usage_context: str
    num_replicas: int
    router: str
    label: str
    # Disaggregated prefill/decode (xPyD, ``simulator.disaggregated``): 0 and 0 aggregated;
    # kv_link: the link preset between instances (None: the profile's measured link or NVLink).
    prefill_instances: int
    decode_instances: int
    kv_link: str | None
    # each pool's engine-argument overrides (core/pool_args.py): {} = the engine's arguments
    prefill_args: dict[str, Any]
    decode_args: dict[str, Any]

    def __init__(self, engine: EngineArgs | None = None, *, hardware: str = DEFAULT_SIM_HARDWARE,
                 usage_context: str = "server", num_replicas: int = 1,
                 router: str = "round-robin", label: str = "", prefill_instances: int = 0,
                 decode_instances: int = 0, kv_link: str | None = None,
                 prefill_args: Mapping[str, Any] | str | None = None,
                 decode_args: Mapping[str, Any] | str | None = None,
                 **engine_args: Any) -> None:
        if engine is None:
            engine = EngineArgs.from_mapping({"model": DEFAULT_SIM_MODEL, **engine_args},
                                             "SimConfig")
        elif engine_args:
            engine = EngineArgs.from_mapping({**asdict(engine), **engine_args}, "SimConfig")
        self.engine, self.hardware, self.usage_context = engine, hardware, usage_context
        self.num_replicas, self.router, self.label = num_replicas, router, label
        if usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got "
                             f"{usage_context!r}.")
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) \
                or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}.")
        router_class(router)
        self.prefill_instances, self.decode_instances = prefill_instances, decode_instances
        self.kv_link = kv_link
        self.prefill_args = check_pool_args(prefill_args, "prefill_args")
        self.decode_args = check_pool_args(decode_args, "decode_args")
        self._check_disaggregated()

    def _check_disaggregated(self) -> None:
        for name in ("prefill_instances", "decode_instances"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")
        if (self.prefill_instances == 0) != (self.decode_instances == 0):
            raise ValueError("prefill_instances and decode_instances go together: both >= 1 "
                             "(disaggregated) or both 0 (aggregated).")
        if self.disaggregated and self.num_replicas != 1:
            raise ValueError("num_replicas is for aggregated replicas: a disaggregated fleet "
                             "takes prefill_instances and decode_instances instead.")
        if self.kv_link is not None and not self.disaggregated:
            raise ValueError("kv_link is set but the fleet is not disaggregated (set "
                             "prefill_instances and decode_instances).")
        if self.kv_link is not None and (not isinstance(self.kv_link, str) or not self.kv_link):
            raise ValueError(f"kv_link must be a link name, got {self.kv_link!r}.")
        for name in ("prefill_args", "decode_args"):
            if getattr(self, name) and not self.disaggregated:
                raise ValueError(f"{name} is set but the fleet is not disaggregated (set "
                                 "prefill_instances and decode_instances).")
            pool_engine_args(self.engine, getattr(self, name), name)  # (a bad value, named)

    def pool_engine(self, pool: str) -> EngineArgs:
        """The engine arguments of the ``prefill`` or ``decode`` pool."""
        return pool_engine_args(self.engine, getattr(self, f"{pool}_args"), f"{pool}_args")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_instances > 0

    @classmethod
    def from_flat(cls, values: dict[str, Any], source: str = "SimConfig") -> SimConfig:
        """From one flat mapping of engine arguments and ``SIM_KEYS`` (a sweep point, a file)."""
        sim = {k: values[k] for k in SIM_KEYS + PD_KEYS if k in values}
        engine = {k: v for k, v in values.items() if k not in SIM_KEYS + PD_KEYS}
        return cls(EngineArgs.from_mapping({"model": DEFAULT_SIM_MODEL, **engine}, source),
                   **sim)

    def replace(self, **changes: Any) -> SimConfig:
        """A copy with ``changes`` (engine arguments or ``SIM_KEYS``)."""
        return SimConfig.from_flat({**self.flat(), **changes})

    def flat(self) -> dict[str, Any]:
        """The engine arguments and ``SIM_KEYS`` in one flat dict (``from_flat``'s inverse)."""
        return {**asdict(self.engine), **{k: getattr(self, k) for k in self.sim_keys}}

    @property
    def sim_keys(self) -> tuple[str, ...]:
        """The keys besides the engine's this run records (PD_KEYS only when disaggregated)."""
        return SIM_KEYS + PD_KEYS if self.disaggregated else SIM_KEYS

    @property
    def model(self) -> str:
        return self.engine.model or DEFAULT_SIM_MODEL

    @property
    def scheduling_policy(self) -> str:
        return self.engine.scheduling_policy


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    engine_config: EngineConfig
    records: list[RequestRecord]
    steps: StepLog  # a Sequence[StepRecord]
    summary: dict[str, Any]
    wall_time_s: float
    cost_model: str = ""  # which profile and data the step times rest on (DeviceCostModel.describe)
    roofline_gap: str = ""  # on a roofline only: how far rooflines fell short where measured
    kernel_mismatch: str = ""  # the fit ran other kernels, or steps short of this run's
    # a disaggregated run's per-request parts (run folder columns); None: aggregated
    disaggregated: dict[str, DisaggregatedParts] | None = None

    @property
    def num_gpu_blocks(self) -> int:
        return self.engine_config.scheduler.num_gpu_blocks


@dataclass(frozen=True, slots=True)
class EngineBuild:
    """One replica as ``build_engine_config`` resolves it: the engine configuration (the real
    engine's resolution, for the profile's device), its cost model and the model at the
    resolved dtype and quantization."""

    engine_config: EngineConfig
    cost_model: DeviceCostModel
    model: ModelConfig


def build_engine_config(cfg: SimConfig) -> EngineBuild:
    """The engine configuration, cost model and model of one replica of ``cfg``."""
    hardware = load_hardware(cfg.hardware)
    spec = load_model_spec(cfg.model)
    args, platform, tp = cfg.engine, hardware.platform(), cfg.engine.tensor_parallel_size
    if args.device not in ("auto", platform.device_type):
        raise ValueError(f"device {args.device!r} does not match the hardware profile "
                         f"{hardware.name!r}, a {platform.device_type} device: the twin's device "
                         "is its profile (leave device at auto).")
    first = resolve_engine_config(args, spec, platform, cfg.usage_context)
    spec = spec.with_dtype(first.dtype).with_quantization(args.quantization, args.kv_cache_dtype)
    cost = make_cost_model(spec, hardware, tp, args.block_size)
    resolved = first
    if platform.device_type != "cpu":
        roofline = cost.roofline
        sched = first.scheduler
        non_kv = roofline.weight_bytes_per_gpu + roofline.activation_reserve_bytes(
            sched.max_num_batched_tokens, sched.max_num_seqs)
        resolved = resolve_engine_config(args, spec, platform, cfg.usage_context, non_kv)
    if resolved.scheduler.kv_cache_group_windows:  # a hybrid block spans one group's layers
        cost = make_cost_model(spec, hardware, tp, args.block_size,
                               kv_block_bytes=resolved.block_bytes)
    return EngineBuild(resolved, cost, spec)


def to_request(tr: TraceRequest, vocab_size: int, block_size: int,
               prompt: list[int] | LazyPrompt | None = None, params: SamplingParams | None = None) -> Request:
    """The engine request for a trace row (``prompt`` and ``params``: its prompt ids and sampling
    parameters, when already made). The SJF policy's length hint is the trace's own output length
    (an oracle, as simulators usually assume)."""
    if prompt is None:
        prompt = tr.prompt_token_ids(vocab_size, block_size)
    # (a lazy prompt's request keeps its outputs, every one the twin's token, as their count)
    outputs: list[int] | RepeatedTokenIds = (RepeatedTokenIds(SIMULATED_TOKEN)
                                             if type(prompt) is LazyPrompt else [])
    return Request(tr.request_id, prompt, params or _sampling_params(tr.output_tokens),
                   tr.arrival_time, priority=tr.priority, tenant=tr.tenant, lora=tr.lora,
                   hints={"output_len_hint": float(tr.output_tokens)}, output_token_ids=outputs)


def _sampling_params(output_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_tokens, ignore_eos=True)


def _engine_requests(trace: list[TraceRequest], vocab_size: int, block_size: int,
                     structured: StructuredWorkload | None = None,
                     lazy: bool = True) -> Iterator[Request]:
    """``to_request`` of each row, made as the replay reaches it: prompts as ``LazyPrompt``s
    (their ids made only where the engine reads them, their blocks' prefix-cache keys from the
    request's identity: ``traces.iter_prompt_parts``; ``lazy=False``: the plain id lists, the
    reference), and one SamplingParams per output length (the engine only reads them, as
    forked samples share theirs). ``structured``: which requests decode under a grammar
    (``structured_cost``)."""
    shared: dict[int, SamplingParams] = {}
    # a prompt's ids past its shared prefix come from its request id: its own unless another
    # request of the trace has the same id
    unique = len({tr.request_id for tr in trace}) == len(trace)
    prompts: Iterator[list[int] | LazyPrompt] = (
        map(partial(_lazy_prompt, vocab_size, block_size, unique), trace,
            iter_prompt_parts(trace, vocab_size, block_size)) if lazy
        else iter_prompt_token_ids(trace, vocab_size))
    for tr, prompt in zip(trace, prompts):
        params = shared.get(tr.output_tokens)
        if params is None:
            params = shared[tr.output_tokens] = _sampling_params(tr.output_tokens)
        if structured is not None:
            params = structured.params(params, tr.request_id)
        yield to_request(tr, vocab_size, block_size, prompt, params)


def _lazy_prompt(vocab_size: int, block_size: int, unique_ids: bool, tr: TraceRequest,
                 parts: PromptParts) -> LazyPrompt:
    # (from the block past the shared prefix's end, where the block that holds the end is a
    # full block of the prompt: it may be another prompt's too, where their first own ids
    # coincide; one the outputs fill is this request's own)
    shared = tr.num_prefix_tokens
    end = -(-shared // block_size) * block_size
    own = (end if end <= tr.input_tokens else shared) if unique_ids and shared < tr.input_tokens \
        else None
    return LazyPrompt(tr.input_tokens, partial(prompt_ids_slice, tr, vocab_size),
                      parts.tail_start, parts.tail, block_size, parts.keys, own)


def simulate(cfg: SimConfig, trace: list[TraceRequest], progress: bool = False,
             adapters: LoRAAdapters | None = None,
             structured: StructuredWorkload | None = None,
             decode_runs: bool = True, lazy_prompts: bool = True,
             router: Router | None = None,
             acceptance: AcceptanceProfile | None = None,
             stop_when: Callable[[Sequence[RequestRecord]], bool] | None = None,
             replicas_apart: bool = True) -> SimResult:
    """Replays ``trace`` (sorted by arrival) through ``cfg.num_replicas`` simulated engines.
    ``adapters``: the shapes of the LoRA adapters the requests name (see ``lora_run``);
    ``structured``: the requests that decode under a grammar, charged its mask time;
    ``decode_runs``: advance runs of decode-only steps at once (``core.decode_run``; False
    steps one at a time, the reference, with the same results); ``lazy_prompts``: prompts
    as ``LazyPrompt``s (False: plain id lists, the reference, with the same results);
    ``router``: a router object in place of ``cfg.router``'s defaults (a tuned one); the
    replicas record KV events only when the router reads them;
    ``acceptance``: the drafts' measured acceptance (with speculation; else the configuration's
    ``synthetic_acceptance_rate``), the step time charged for verification and proposer
    (``spec_cost``); ``stop_when``: asked with the records finished so far each time requests
    finish, ends the replay early when it returns True (the planner's decided verdicts): the
    result then holds only the requests finished by then; ``replicas_apart``: a fleet behind a
    router that reads nothing of the replicas runs each replica in its own environment
    (``simulator.fleet_apart``; False: one environment, the reference, with the same results)."""
    if cfg.disaggregated:
        return _simulate_disaggregated(cfg, trace, adapters, structured, router, acceptance,
                                       lazy_prompts, stop_when)
    t0 = time.perf_counter()
    build = build_engine_config(cfg)
    engine_config, cost, spec = build.engine_config, build.cost_model, build.model
    lora = lora_cost_for(cfg.engine, spec, cost.hardware, trace, adapters)
    if lora is not None:
        cost = cost.with_lora(lora)
    sched_cfg, vocab, block_size = (engine_config.scheduler, spec.vocab_size,
                                    cfg.engine.block_size)
    if router is None:
        router = fleet_router(cfg, cost, sched_cfg)
    if uses_kv_events(router):
        sched_cfg = replace(sched_cfg, kv_events=True)
    recorder = RunRecorder(record_tenants=len({tr.tenant for tr in trace}) > 1)
    with _cyclic_gc_paused():
        env = simpy.Environment()
        # with LoRA each replica's step time also tallies its adapter loads
        step: StepTimeModel = cost if structured is None else \
            structured_cost_of(cost.hardware).wrap(cost)
        pipe = None
        if cfg.engine.pipeline_parallel_size > 1:  # the stages, their transfers, the bubble
            from twinserve.simulator.pipeline import PipelineCost
            step = pipe = PipelineCost(step, spec, cost.hardware,
                                       cfg.engine.pipeline_parallel_size,
                                       cfg.engine.tensor_parallel_size,
                                       cfg.engine.layer_partition())
        spec_cfg = cfg.engine.speculation
        if spec_cfg is not None:
            from twinserve.simulator.spec_cost import with_speculation
            step = with_speculation(step, cost, spec_cfg, cfg.engine.kernel_settings())
        # (once the configuration is checked: a refused one prints no bar)
        bar = _progress_bar(len(trace)) if progress else None
        recorder.on_finish = bar.update if bar is not None else None
        tallies = ([] if lora is None else
                   [LoadTally(step, cost.lora_load_time) for _ in range(cfg.num_replicas)])
        models: list[StepTimeModel] = [*tallies] if tallies else [step] * cfg.num_replicas
        fleet = cfg.num_replicas > 1
        # a fleet's fast path: each replica runs ahead up to the next arrival (engine.Replica)
        horizons = (ArrivalHorizons([deque() for _ in range(cfg.num_replicas)],
                                    arrival_times=sorted(tr.arrival_time for tr in trace))
                    if fleet and decode_runs else None)
        tiers = [_host_tier(engine_config, block_size, cost.hardware)
                 for _ in range(cfg.num_replicas)]
        replicas = [Replica(i, StepDriver(Scheduler(sched_cfg, policy, stream_outputs=False,
                                                    speculation=speculation_policy_for(spec_cfg),
                                                    kv_connector=tiers[i][0]),
                                          recorder, i), model,
                            SyntheticTokens(AcceptanceModel.of(spec_cfg, cfg.engine.seed + i,
                                                               acceptance)),
                            decode_runs=decode_runs, alone=not fleet or not reads_loads(router),
                            horizons=horizons)
                    for i, (policy, model) in enumerate(zip(_policies(cfg), models))]
        requests = _engine_requests(trace, vocab, block_size, structured, lazy_prompts)
        # the engine's batch queue (pp batches in flight), where the engine runs one
        queued = pipe if spec_cfg is None and lora is None else None
        if (replicas_apart and horizons is not None and not reads_loads(router)
                and stop_when is None and queued is None and all(w is None for _, w in tiers)):
            run_apart(replicas, requests, router, recorder, horizons.arrival_times or (),
                      engine_process)
        else:
            env.process(arrival_process(env, requests, replicas, router, recorder, horizons))
            for replica, (_, worker) in zip(replicas, tiers):
                env.process(_engine_loop(env, replica, worker, queued))
            if stop_when is not None:
                recorder.on_finish = _stopper(env, recorder, stop_when, recorder.on_finish)
            env.run()
    if bar is not None:
        bar.close()
    if fleet:  # the replicas' rows interleaved as in time, whichever ran ahead
        recorder.steps.sort_by_time()
        records = sorted(recorder.requests, key=lambda r: (r.arrival_time, r.request_id))
    else:
        records = sorted(recorder.requests, key=_arrival_time)
    duration = max((r.finish_time for r in records if r.success), default=0.0)
    summary = summarize(records, duration_s=duration or None)
    if lora is not None:
        summary.update(lora_summary(records, trace, tallies))
    if tiers[0][0] is not None:
        summary.update(kv_offload_summary([t[0].stats for t in tiers]))  # type: ignore[union-attr]
    gap = roofline_caveat() if isinstance(cost, CostModel) else ""
    return SimResult(cfg, engine_config, records, recorder.steps, summary,
                     time.perf_counter() - t0, cost.describe(), gap,
                     _kernel_mismatch(cost, cfg, engine_config, trace))


def fleet_router(cfg: SimConfig, cost: StepTimeModel, limits: SchedulerConfig) -> Router:
    """The router ``simulate`` builds for ``cfg`` (without one given): ``cfg.router``, priced on
    the run's step-time model within its engine's limits (``simulator.router_prices``) where
    there is a fleet to route."""
    prices = router_prices(cost, limits) if cfg.num_replicas > 1 else None
    return make_router(cfg.router, cfg.engine.block_size, prices)


def _simulate_disaggregated(cfg: SimConfig, trace: list[TraceRequest],
                            adapters: LoRAAdapters | None, structured: StructuredWorkload | None,
                            router: Router | None, acceptance: AcceptanceProfile | None,
                            lazy_prompts: bool,
                            stop_when: Callable[[Sequence[RequestRecord]], bool] | None,
                            ) -> SimResult:
    """``simulate`` for an xPyD fleet (``simulator.disaggregated``, imported here: it builds on
    this module). What the fleet does not model yet is refused by name."""
    from twinserve.simulator.disaggregated import simulate_disaggregated
    refused = {"adapters": adapters, "structured": structured, "router": router,
               "acceptance": acceptance}
    for name, value in refused.items():
        if value is not None:
            raise ValueError(f"{name} is not supported with a disaggregated fleet yet.")
    args = cfg.engine
    for arg, is_set in (("enable_lora", bool(args.enable_lora)),
                        ("speculative_config", args.speculative_config is not None),
                        ("pipeline_parallel_size", args.pipeline_parallel_size != 1),
                        ("kv_offloading_size", args.kv_offloading_size is not None)):
        if is_set:
            raise ValueError(f"{arg} is not supported with a disaggregated fleet yet.")
    spec = load_model_spec(cfg.model)
    requests = _engine_requests(trace, spec.vocab_size, args.block_size, None, lazy_prompts)
    return simulate_disaggregated(cfg, trace, requests, stop_when)


def _progress_bar(total: int) -> Any:
    """A tqdm bar (imported here: a run without one never loads tqdm, which also starts a
    monitor thread when disabled)."""
    from tqdm import tqdm
    return tqdm(total=total, unit="req", desc="simulating", mininterval=0.5)


def _engine_loop(env: simpy.Environment, replica: Replica, worker: Any,
                 queued: PipelineCost | None) -> Any:
    """A replica's engine process: with a host KV tier, with the pipeline's batch queue, or
    plain (the modules of the first two loaded only where a run needs them)."""
    if worker is not None:
        from twinserve.simulator.kv_offload import offloading_engine_process
        return offloading_engine_process(env, replica, worker)
    if queued is not None:
        from twinserve.simulator.pipeline import pipelined_engine_process
        return pipelined_engine_process(env, replica, queued)
    return engine_process(env, replica)


def _stopper(env: simpy.Environment, recorder: RunRecorder,
             stop_when: Callable[[Sequence[RequestRecord]], bool],
             then: Callable[[int], None] | None) -> Callable[[int], None]:
    """``recorder.on_finish`` that stops ``env`` (SimPy's own ``until`` mechanism: an event
    whose callback raises ``StopSimulation``) once ``stop_when`` holds."""
    stop = env.event()
    stop.callbacks.append(simpy.core.StopSimulation.callback)

    def on_finish(n: int) -> None:
        if then is not None:
            then(n)
        if not stop.triggered and stop_when(recorder.requests):
            stop.succeed()
    return on_finish


def _host_tier(engine_config: EngineConfig, block_size: int, hardware: HardwareProfile,
               ) -> tuple[OffloadingConnectorScheduler | None, TwinOffloadingWorker | None]:
    """A replica's host KV tier (``--kv-offloading-size``): its scheduler side and the twin's
    worker side over the profile's PCIe link; (None, None) without one. Another connector in
    an aggregated run is refused by name (P/D runs take prefill/decode instances)."""
    kv_transfer = engine_config.kv_transfer_config
    if kv_transfer is None:
        return None, None
    if kv_transfer.kv_connector != OFFLOADING_CONNECTOR:
        raise ValueError(f"kv_transfer_config.kv_connector {kv_transfer.kv_connector!r} in the twin "
                         "needs a disaggregated fleet (prefill and decode instances).")
    from twinserve.simulator.kv_offload import TwinOffloadingWorker, host_link_of
    return (OffloadingConnectorScheduler(kv_transfer, block_size),
            TwinOffloadingWorker(host_link_of(hardware), engine_config.block_bytes))


def _kernel_mismatch(cost: DeviceCostModel, cfg: SimConfig, engine_config: EngineConfig,
                     trace: Sequence[TraceRequest]) -> str:
    """How the fit's measurement differs from this run ("": not at all, or a fit that records
    nothing, such as the bundled GPU fits): the kernel settings it ran (the twin prices the
    measured kernels whatever the engine arguments name), and steps past its measured space
    that the trace can reach (no more sequences than requests, no longer context than its
    longest request, no more tokens than all its prompts)."""
    if not isinstance(cost, FittedCostModel):
        return ""
    params, parts = cost.params, []
    if params.kernel_settings:
        parts.append(kernel_settings_mismatch(params.to_dict(), cfg.engine.kernel_settings()))
    spec, sched = cfg.engine.speculation, engine_config.scheduler
    reach = {"max_num_seqs": min(sched.max_num_seqs, len(trace)),
             "max_num_batched_tokens": min(sched.max_num_batched_tokens,
                                           sum(r.input_tokens for r in trace)),
             "max_model_len": min(engine_config.max_model_len, max(
                 (r.input_tokens + r.output_tokens for r in trace), default=0))}
    parts.append(params.beyond(reach, spec.max_drafts if spec is not None else 0))
    return "; ".join(p for p in parts if p)


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pauses Python's cycle collector for a replay, restoring the caller's setting after.

    A replay makes next to no cyclic garbage (reference counting frees what it drops), while the
    collector would keep walking every KV block of every replica (tens of thousands each), every
    live request and record: ~3% of a 1-replica run, and a share that grows with the replicas.
    What the replay leaves (a row per step, a record per request) is then moved to the oldest
    generation in O(1), rather than walked by the first young collection after the run; not when
    the caller has frozen objects itself (``gc.unfreeze`` would thaw those too)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():
            gc.freeze()  # every tracked object to the permanent generation ...
            gc.unfreeze()  # ... and from there to the oldest one
        if was_enabled:
            gc.enable()


def _policies(cfg: SimConfig) -> list[SchedulingPolicy]:
    """A fresh policy per replica; the registry (an entry-point scan) is consulted once."""
    args = cfg.engine
    first = get_policy(args.scheduling_policy, **args.policy_options)
    return [first, *(type(first)(**args.policy_options) for _ in range(cfg.num_replicas - 1))]


def write_sim_run(result: SimResult, out_dir: str | Path, trace_desc: dict[str, Any]) -> Path:
    """Writes the run folder; its config records everything needed to rerun it."""
    config = {"backend": "sim", **result.engine_config.to_dict(),
              **{k: getattr(result.config, k) for k in result.config.sim_keys}, **trace_desc}
    if not config.get("label"):
        config["label"] = f"sim {result.config.scheduling_policy}"
    if result.cost_model:
        config["cost_model"] = result.cost_model
    if result.roofline_gap:
        config["roofline_gap"] = result.roofline_gap
    return write_run(out_dir, config, result.records, result.summary, result.steps,
                     result.disaggregated)
