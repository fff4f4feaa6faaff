"""The real engine: the shared scheduler driving the model runner, one step at a time.

    out  = scheduler.schedule(now)
    res  = runner.execute(out)                 # forward pass + sampling
    outs = scheduler.update_from_output(out, res, now_after)

Time is the engine's monotonic clock in seconds since it started, so run records line up with the
simulator's (which starts at 0 too).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from twinserve.core.config import SchedulerConfig
from twinserve.core.metrics import RequestRecord, StepRecord
from twinserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from twinserve.core.request import Request
from twinserve.core.request_output import RequestOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import Scheduler
from twinserve.gpu.model_runner import ModelRunner
from twinserve.gpu.output_processor import OutputProcessor
from twinserve.policies import get_policy


@dataclass(slots=True)
class EngineArgs:
    """The real engine's knobs, under vLLM's names."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    scheduling_policy: str = "fcfs"
    policy_options: dict[str, Any] = field(default_factory=dict)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "recompute"
    kv_cache_memory: int | None = None  # bytes, CPU; default 2 GiB
    gpu_memory_utilization: float = 0.9
    swap_space: float = 1.0  # GiB
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False
    seed: int = 0


@dataclass(slots=True)
class EngineMetrics:
    """Per-step and per-request records for run folders (see core.run_dir)."""

    steps: list[StepRecord] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    record_steps: bool = True
    record_requests: bool = True

    def take_requests(self) -> list[RequestRecord]:
        """The finished-request records since the last call (a long-running server drains them)."""
        taken, self.requests = self.requests, []
        return taken


class LLMEngine:
    def __init__(self, args: EngineArgs, runner: ModelRunner | None = None) -> None:
        self.args = args
        self.runner = runner or ModelRunner(
            args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization, swap_space=args.swap_space,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
            enforce_eager=args.enforce_eager, seed=args.seed)
        num_blocks = args.num_gpu_blocks_override or self.runner.num_gpu_blocks
        if num_blocks > self.runner.num_gpu_blocks:
            raise ValueError(f"num_gpu_blocks_override ({num_blocks}) exceeds the "
                             f"{self.runner.num_gpu_blocks} blocks the KV cache holds.")
        self.config = SchedulerConfig(
            num_gpu_blocks=num_blocks, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max(args.max_num_batched_tokens,
                                       0 if args.enable_chunked_prefill else self.runner.max_model_len),
            max_model_len=self.runner.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            enable_prefix_caching=args.enable_prefix_caching,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            preemption_mode=args.preemption_mode, num_cpu_blocks=self.runner.num_cpu_blocks)
        self.policy = get_policy(args.scheduling_policy, **args.policy_options)
        self.scheduler = Scheduler(self.config, self.policy)
        self.tokenizer = self.runner.tokenizer
        self.outputs = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics()
        self._t0 = time.monotonic()
        self._ids = itertools.count()
        self.num_steps = 0

    def now(self) -> float:
        return time.monotonic() - self._t0

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, tenant: str = "default", lora: str | None = None,
                    hints: dict[str, float] | None = None, detokenize: bool = True) -> str:
        """Queues a request; returns its id. Raises ValueError naming what is wrong."""
        params = params or SamplingParams()
        if priority != 0 and not self.policy.uses_priority:
            raise ValueError(f"Got priority {priority} but the {self.policy.name!r} scheduling "
                             "policy does not use priorities (use scheduling_policy='priority').")
        token_ids, text = self._prompt_tokens(prompt)
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {params.stop_token_ids}.")
        rid = request_id or f"req-{next(self._ids)}"
        request = Request(rid, token_ids, params,
                          self.now() if arrival_time is None else arrival_time,
                          eos_token_id=self.runner.eos_token_id, priority=priority,
                          tenant=tenant, lora=lora, hints=dict(hints or {}))
        self.scheduler.add_request(request)
        try:
            self.outputs.add(request, text, detokenize)
        except ValueError:
            self.scheduler.abort_requests([rid], self.now())
            raise
        return rid

    def _prompt_tokens(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids.")
            if not prompt:
                raise ValueError("prompt must not be empty.")
            return self.tokenizer.encode(prompt, add_special_tokens=True), prompt
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt must be a non-empty string or list of token ids.")
        vocab = self.runner.vocab_size
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}.")
        return list(prompt), None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request and all its samples, freeing their KV blocks."""
        ids = self.outputs.sample_ids(request_id)
        self.scheduler.abort_requests(ids, self.now())
        return self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler
        start = self.now()
        out = sched.schedule(start)
        if out.scheduled or out.finished_request_ids or out.blocks_to_swap_out:
            result = self.runner.execute(out)
        else:
            result = ModelRunnerOutput()
        end = self.now()
        core_outs = sched.update_from_output(out, result, end)
        finished = [o.request_id for o in core_outs if o.finished]
        results, stopped = self.outputs.process(core_outs)
        if stopped:
            sched.finish_requests(stopped, end)
            finished += stopped
        self.num_steps += 1
        if out.scheduled and self.metrics.record_steps:
            self.metrics.steps.append(StepRecord.from_step(out, sched, start, end - start))
        if finished and self.metrics.record_requests:
            self._record_finished(out, finished)
        return results

    def _record_finished(self, out: SchedulerOutput, finished: list[str]) -> None:
        by_id = {sr.request.request_id: sr.request for sr in out.scheduled}
        for rid in finished:
            req = by_id.get(rid)
            if req is not None and req.parent_id is None:
                self.metrics.requests.append(RequestRecord.from_request(req))
