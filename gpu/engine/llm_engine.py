"""The real engine: the shared scheduler driving the model runner, one step at a time.

    out  = driver.schedule(now)                       # core.step_driver: the one step seam
    res  = driver.execute(runner, out)                # forward pass + sampling
    outs = driver.complete(out, res, now, now_after)  # update_from_output, records

Time is the engine's monotonic clock in seconds since it started, so run records line up with the
simulator's (which starts at 0 too).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Any

from twinserve.core.batch_queue import BatchQueue
from twinserve.core.config import SchedulerConfig
from twinserve.core.engine_args import EngineArgs
from twinserve.core.kv_connector import KVConnectorOutput, make_connector_scheduler
from twinserve.core.lora import LoRARequest
from twinserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from twinserve.core.pooling_params import PoolingParams
from twinserve.core.request import Request
from twinserve.core.request_output import EmbeddingRequestOutput, KVLoadTiming, RequestOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import Scheduler
from twinserve.core.speculation import SpeculationPolicy
from twinserve.core.step_driver import StepDriver
from twinserve.gpu.engine.batch_queue import QueuedStep, step_with_batch_queue
from twinserve.gpu.engine.output_processor import OutputProcessor
from twinserve.gpu.engine.request_surface import RequestSurface
from twinserve.gpu.worker.model_runner import ModelRunner
from twinserve.policies import get_policy
from twinserve.policies.speculation import speculation_policy_for

CONNECTOR_IDLE_WAIT_S = 0.005  # a step with only KV transfers pending waits this long for news


def speculation_policy(args: EngineArgs, config: SchedulerConfig) -> SpeculationPolicy | None:
    """The scheduler's speculation policy for ``args.speculative_config`` (None: off)."""
    spec = args.speculation
    if spec is None or not config.num_speculative_tokens:
        return None
    return speculation_policy_for(replace(spec, policy=config.speculation_policy))


class LLMEngine:
    """The shared scheduler and the model runner, joined by the one step driver.

    ``usage_context`` picks vLLM's defaults for offline use (``llm``) or a server (``server``);
    ``config`` is the resolved configuration (``core.engine_config.EngineConfig``)."""

    def __init__(self, args: EngineArgs, runner: ModelRunner | None = None,
                 usage_context: str = "llm") -> None:
        if args.data_parallel_size > 1:  # refused, not dropped: replicas need a front
            raise ValueError(f"data_parallel_size={args.data_parallel_size}: an LLMEngine is one "
                             "replica; LLM(data_parallel_size=N) and serve start N behind a router.")
        if args.kv_transfer_config is not None and args.speculation is not None:
            raise ValueError("kv_transfer_config with speculative_config is not implemented.")
        self.args = args
        self.runner = runner or ModelRunner(args, usage_context)
        self.engine_config = self.runner.engine_config
        self.config = self.engine_config.scheduler
        self.policy = get_policy(args.scheduling_policy, **args.policy_options)
        kv_transfer = self.engine_config.kv_transfer_config  # (kv_offloading_size resolved)
        self.scheduler = Scheduler(
            self.config, self.policy, speculation=speculation_policy(args, self.config),
            kv_connector=None if kv_transfer is None else
            make_connector_scheduler(kv_transfer, self.config.block_size))
        self.driver = StepDriver(self.scheduler)
        self.metrics = self.driver.recorder
        self.tokenizer = self.runner.tokenizer
        self.outputs = OutputProcessor(self.tokenizer)
        self.request_surface = RequestSurface(self.tokenizer, self.runner.max_model_len,
                                              self.runner.config.hidden_size)
        self._t0 = time.monotonic()
        self._ids = itertools.count()
        self.num_steps = 0
        self._lora_of: dict[str, str] = {}  # request id -> its adapter, pinned until it ends
        # a consumer's finished KV loads, until their request's next output carries them
        self._kv_loads: dict[str, KVLoadTiming] = {}
        # vLLM's batch queue under pipeline parallelism: up to pp batches in flight (None: one
        # step at a time; set it to None to run a pipeline without it, as benchmarks/pp_comm does)
        self.batch_queue: BatchQueue[QueuedStep] | None = (
            BatchQueue(self.scheduler, args.pipeline_parallel_size)
            if self.runner.can_queue_batches else None)

    def now(self) -> float:
        return time.monotonic() - self._t0

    @property
    def time_origin(self) -> float:
        """The ``time.monotonic()`` at which this engine's clock (``now``, its run records) is 0."""
        return self._t0

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, tenant: str = "default",
                    lora_request: LoRARequest | None = None,
                    hints: dict[str, float] | None = None, detokenize: bool = True,
                    pooling_params: PoolingParams | None = None,
                    kv_transfer_params: dict[str, Any] | None = None) -> str:
        """Queues a request; returns its id. Raises ValueError naming what is wrong (an
        adapter that cannot be loaded included), EngineOverloaded when it must wait.
        ``pooling_params``: an embedding request (prefill only; its output is an
        ``EmbeddingRequestOutput``). ``kv_transfer_params``: disaggregated prefill/decode
        (vLLM's keys, ``core.kv_connector``; needs a kv_transfer_config)."""
        params = params or SamplingParams()
        params.validate()  # attributes may have changed since construction
        if self.runner.tp is not None and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs with tensor_parallel_size or pipeline_parallel_size "
                             "> 1 is not implemented.")
        if pooling_params is not None and getattr(self.runner.model, "pipeline", None) is not None:
            raise ValueError("embedding requests (pooling_params) with pipeline_parallel_size > 1 "
                             "are not implemented (the last stage holds the hidden states).")
        if priority != 0 and not self.policy.uses_priority:
            raise ValueError(f"Got priority {priority} but the {self.policy.name!r} scheduling "
                             "policy does not use priorities (use scheduling_policy='priority').")
        token_ids, text = self._prompt_tokens(prompt)
        token_ids = self.request_surface.prepare(token_ids, params, pooling_params)
        vocab = self.runner.vocab_size
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            ids = getattr(params, name) or ()
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"{name}: token ids must be in [0, {vocab}), got "
                                 f"{sorted(t for t in ids if not 0 <= t < vocab)[:8]}.")
        rid = request_id or f"req-{next(self._ids)}"
        lora = self._acquire_lora(lora_request)
        try:
            request = Request(rid, token_ids, params,
                              self.now() if arrival_time is None else arrival_time,
                              eos_token_id=self.runner.eos_token_id, priority=priority,
                              tenant=tenant, lora=lora, hints=dict(hints or {}),
                              pooling_params=pooling_params,
                              kv_transfer_params=kv_transfer_params)
            self.driver.add_request(request)
        except BaseException:
            self._release_lora_name(lora)
            raise
        if lora is not None:
            self._lora_of[rid] = lora
        try:
            self.outputs.add(request, text, detokenize)
        except ValueError:
            self.driver.abort([rid], self.now())
            self._release_lora(rid)
            raise
        self.runner.prefetch_grammar(request)  # checked above; compiled while steps run
        return rid

    def _acquire_lora(self, lora_request: LoRARequest | None) -> str | None:
        if lora_request is None:
            return None
        if self.runner.lora is None:
            raise ValueError(f"LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r} "
                             "requested but LoRA is not enabled (enable_lora=True).")
        return self.runner.lora.acquire(lora_request)

    def _release_lora(self, request_id: str) -> None:
        self._release_lora_name(self._lora_of.pop(request_id, None))

    def _release_lora_name(self, name: str | None) -> None:
        if name is not None and self.runner.lora is not None:
            self.runner.lora.release(name)

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

    def abort_request(self, request_id: str) -> RequestOutput | EmbeddingRequestOutput | None:
        """Ends a request and all its samples, freeing their KV blocks."""
        ids = self.outputs.sample_ids(request_id)
        self.driver.abort(ids, self.now())
        self._release_lora(request_id)
        self._kv_loads.pop(request_id, None)
        return self.outputs.abort(request_id)

    def shutdown(self) -> None:
        """Ends the tensor-parallel workers, if any (also done at exit and on garbage collection)."""
        self.runner.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _poll_connector(self, out: SchedulerOutput) -> KVConnectorOutput:
        """A step the driver ran no forward pass for (only transfers pend): hand the connector
        its orders and wait briefly for news rather than spin."""
        connector = self.runner.kv_connector
        assert connector is not None and out.kv_connector_metadata is not None
        connector.start(out.kv_connector_metadata)
        connector.wait(CONNECTOR_IDLE_WAIT_S)
        return connector.get_finished()

    def _attach_kv_loads(self, results: list[RequestOutput | EmbeddingRequestOutput]) -> None:
        """Each finished KV load rides on its request's next output (the one with its first
        token, or the one that ends it), so a front sets the transfer beside its own times."""
        take = getattr(self.runner.kv_connector, "take_records", None)  # (the host tier: none)
        if take is None:
            return
        self._kv_loads.update(take())
        if self._kv_loads:
            for output in results:
                timing = self._kv_loads.pop(output.request_id, None)
                if timing is not None and isinstance(output, RequestOutput):
                    output.kv_load = timing

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        if self.batch_queue is not None:
            return step_with_batch_queue(self, self.batch_queue)
        driver = self.driver
        t0 = time.perf_counter()
        start = self.now()
        out = driver.schedule(start)
        result = driver.execute(self.runner, out)
        if out.kv_connector_metadata is not None and result.kv_connector_output is None:
            result.kv_connector_output = self._poll_connector(out)
        return self.complete_step(out, result, start, self.now(), t0)

    def complete_step(self, out: SchedulerOutput, result: ModelRunnerOutput, start: float,
                      end: float, t0: float) -> list[RequestOutput | EmbeddingRequestOutput]:
        """A step's results applied at ``end`` and processed into request outputs (``t0``: its
        ``perf_counter`` start, for the observers)."""
        driver = self.driver
        results, stopped = self.outputs.process(driver.complete(out, result, start, end),
                                                self.runner.take_dead_ends())
        if stopped:
            driver.finish(stopped, end)
        if self._lora_of:
            for output in results:
                if output.finished:
                    self._release_lora(output.request_id)
        if self.runner.kv_connector is not None:
            self._attach_kv_loads(results)
        self.num_steps += 1
        driver.end_step(out, time.perf_counter() - t0)
        return results
