"""One simulation run: build the replicas from a config, replay a trace, summarise, write a run folder."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import simpy
from tqdm import tqdm

from twinserve.core.config import SchedulerConfig
from twinserve.core.metrics import RequestRecord, StepLog, summarize
from twinserve.core.policy import SchedulingPolicy
from twinserve.core.request import Request
from twinserve.core.run_dir import write_run
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import Scheduler
from twinserve.policies import get_policy
from twinserve.simulator.cost_model import make_cost_model
from twinserve.simulator.engine import Replica, SimRecorder, arrival_process, engine_process
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.router import ROUTERS, make_router
from twinserve.traces import TraceRequest
from twinserve.traces.trace_request import iter_prompt_token_ids

GIB = 2**30


@dataclass(slots=True)
class SimConfig:
    """What to simulate, under vLLM's engine-argument names. ``num_gpu_blocks`` overrides the
    block count derived from memory (as vLLM's ``num_gpu_blocks_override``)."""

    model: str = "llama-3-8b"
    hardware: str = "h100-sxm"
    scheduling_policy: str = "fcfs"
    policy_options: dict[str, Any] = field(default_factory=dict)
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "recompute"
    swap_space: float = 4.0  # GiB of host memory per replica for swap preemption
    num_gpu_blocks: int | None = None
    num_replicas: int = 1
    router: str = "round-robin"
    label: str = ""

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}.")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be at least 1, got {self.num_gpu_blocks}.")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}.")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; valid: {', '.join(ROUTERS)}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}.")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got "
                             f"{self.tensor_parallel_size}.")


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    records: list[RequestRecord]
    steps: StepLog  # a Sequence[StepRecord]
    summary: dict[str, Any]
    num_gpu_blocks: int
    wall_time_s: float


def build_scheduler_config(cfg: SimConfig) -> tuple[SchedulerConfig, Any, int]:
    """Scheduler settings, the cost model and the model's vocabulary size for one replica."""
    spec = load_model_spec(cfg.model)
    cost = make_cost_model(spec, load_hardware(cfg.hardware), cfg.tensor_parallel_size,
                           cfg.block_size)
    roofline = cost.base if hasattr(cost, "base") else cost
    reserve = roofline.activation_reserve_bytes(cfg.max_num_batched_tokens, cfg.max_num_seqs)
    num_blocks = (cfg.num_gpu_blocks if cfg.num_gpu_blocks is not None else
                  cost.num_gpu_blocks(cfg.gpu_memory_utilization, cfg.block_size, reserve))
    block_bytes = roofline.block_bytes()
    sched_cfg = SchedulerConfig(
        num_gpu_blocks=num_blocks, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len or spec.max_position_embeddings,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        enable_prefix_caching=cfg.enable_prefix_caching,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        preemption_mode=cfg.preemption_mode,
        num_cpu_blocks=int(cfg.swap_space * GIB // block_bytes))
    return sched_cfg, cost, spec.vocab_size


def to_request(tr: TraceRequest, vocab_size: int, block_size: int, prompt: list[int] | None = None,
               params: SamplingParams | None = None) -> Request:
    """The engine request for a trace row (``prompt`` and ``params``: its prompt ids and sampling
    parameters, when already made). The SJF policy's length hint is the trace's own output length
    (an oracle, as simulators usually assume)."""
    if prompt is None:
        prompt = tr.prompt_token_ids(vocab_size, block_size)
    return Request(tr.request_id, prompt, params or _sampling_params(tr.output_tokens),
                   tr.arrival_time, priority=tr.priority, tenant=tr.tenant,
                   hints={"output_len_hint": float(tr.output_tokens)})


def _sampling_params(output_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_tokens, ignore_eos=True)


def _engine_requests(trace: list[TraceRequest], vocab_size: int,
                     block_size: int) -> Iterator[Request]:
    """``to_request`` of each row, made as the replay reaches it: prompts in batches, and one
    SamplingParams per output length (the engine only reads them, as forked samples share theirs)."""
    shared: dict[int, SamplingParams] = {}
    for tr, prompt in zip(trace, iter_prompt_token_ids(trace, vocab_size)):
        params = shared.get(tr.output_tokens)
        if params is None:
            params = shared[tr.output_tokens] = _sampling_params(tr.output_tokens)
        yield to_request(tr, vocab_size, block_size, prompt, params)


def simulate(cfg: SimConfig, trace: list[TraceRequest], progress: bool = False) -> SimResult:
    """Replays ``trace`` (sorted by arrival) through ``cfg.num_replicas`` simulated engines."""
    t0 = time.perf_counter()
    sched_cfg, cost, vocab = build_scheduler_config(cfg)
    recorder = SimRecorder(record_tenants=len({tr.tenant for tr in trace}) > 1)
    # tqdm starts a monitor thread even when disabled: no bar at all without progress.
    bar = tqdm(total=len(trace), unit="req", desc="simulating", mininterval=0.5) if progress else None
    recorder.on_finish = bar.update if bar is not None else None
    with _cyclic_gc_paused():
        env = simpy.Environment()
        replicas = [Replica(i, Scheduler(sched_cfg, policy, stream_outputs=False), cost.step_time)
                    for i, policy in enumerate(_policies(cfg))]
        requests = _engine_requests(trace, vocab, cfg.block_size)
        env.process(arrival_process(env, requests, replicas, make_router(cfg.router), recorder))
        for replica in replicas:
            env.process(engine_process(env, replica, recorder))
        env.run()
    if bar is not None:
        bar.close()
    records = sorted(recorder.records, key=lambda r: r.arrival_time)
    duration = max((r.finish_time for r in records if r.success), default=0.0)
    summary = summarize(records, duration_s=duration or None)
    return SimResult(cfg, records, recorder.steps, summary, sched_cfg.num_gpu_blocks,
                     time.perf_counter() - t0)


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
    first = get_policy(cfg.scheduling_policy, **cfg.policy_options)
    return [first, *(type(first)(**cfg.policy_options) for _ in range(cfg.num_replicas - 1))]


def write_sim_run(result: SimResult, out_dir: str | Path, trace_desc: dict[str, Any]) -> Path:
    """Writes the run folder; its config records everything needed to rerun it."""
    config = {"backend": "sim", **asdict(result.config), **trace_desc,
              "num_gpu_blocks": result.num_gpu_blocks}
    if not config.get("label"):
        config["label"] = f"sim {result.config.scheduling_policy}"
    return write_run(out_dir, config, result.records, result.summary, list(result.steps))
