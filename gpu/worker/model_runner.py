"""The real backend of the step seam: ``execute(SchedulerOutput) -> ModelRunnerOutput``.

Per step: swap-outs, swap-ins, block copies, then one forward pass over every scheduled token
(prefill chunks and decodes flattened together) and one batched sampling call.
"""

from __future__ import annotations

import dataclasses

import torch

from twinserve.core.engine_args import EngineArgs
from twinserve.core.engine_config import (
    EngineConfig,
    Platform,
    kv_cache_layout_of,
    resolve_engine_config,
)
from twinserve.core.kv_offload import OFFLOADING_CONNECTOR
from twinserve.core.model_config import ModelConfig
from twinserve.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from twinserve.core.quantization import resolve_quantization
from twinserve.core.request import Request
from twinserve.gpu.distributed.pipeline import PendingLogits
from twinserve.gpu.engine.tokenizer import Tokenizer
from twinserve.gpu.executor.shard_worker import kv_cache_spec
from twinserve.gpu.executor.tp_driver import TPDriver, check_tensor_parallel
from twinserve.gpu.kv_offload import offloading_worker_for
from twinserve.gpu.kv_offload.worker import OffloadingConnectorWorker
from twinserve.gpu.kv_transfer.peer_connector import PeerConnectorWorker, connector_for_runner
from twinserve.gpu.layers.pooler import pooled_state
from twinserve.gpu.lora.lora_manager import LoRAManager
from twinserve.gpu.measurement.gemm_tuning import tune_cpu_gemm
from twinserve.gpu.models.default_model import resolve_model_source
from twinserve.gpu.models.model_loader import load_generation_config, load_model, quantization_config
from twinserve.gpu.worker.batch import ModelInput, build_model_input
from twinserve.gpu.worker.kv_cache import KVCache
from twinserve.gpu.worker.kv_cache_fp8 import use_fp8_kv_cache
from twinserve.gpu.worker.platform import TORCH_DTYPES, current_platform, resolve_device
from twinserve.gpu.worker.prompt_logprobs import PromptLogprobsCollector
from twinserve.gpu.worker.rejection_sampler import VerifySettings
from twinserve.gpu.worker.sampler import sample
from twinserve.gpu.worker.spec_step import SpecStep
from twinserve.gpu.worker.structured_outputs import StructuredOutputs
from twinserve.spec_decode.proposer import Proposer


def check_shareable(owner: ModelRunner, runner: ModelRunner, args: EngineArgs) -> None:
    """Raises ValueError unless ``runner`` (being built from ``args``) can run on ``owner``'s
    weights: the same files, dtype, device, quantization and kernels, positions within the owner's
    tables, and nothing that changes the model in place (tensor parallelism, LoRA, an fp8 KV
    cache)."""
    same = (owner.model_dir, owner.gguf_file, owner.dtype, owner.device, owner.quantization)
    if same != (runner.model_dir, runner.gguf_file, runner.dtype, runner.device,
                runner.quantization):
        raise ValueError(f"weights_from: the runner loaded {same}, not {runner.model_dir} "
                         f"({runner.dtype}, {runner.device}, {runner.quantization}).")
    if owner.kernels != runner.kernels:  # the loaded model holds its kernel choices
        raise ValueError(f"weights_from: the runner loaded {owner.kernels}, not "
                         f"{runner.kernels}.")
    if runner.max_model_len > owner.max_model_len:
        raise ValueError(f"weights_from: max_model_len {runner.max_model_len} exceeds the "
                         f"loaded model's {owner.max_model_len}.")
    changes = [name for name, on in (("tensor_parallel_size > 1", args.tensor_parallel_size > 1),
                                     ("LoRA", args.lora_config() is not None),
                                     ("kv_cache_dtype fp8", args.kv_cache_dtype != "auto"))
               if on]
    owner_changed = (owner.tp is not None or owner.lora is not None
                     or owner.kv_cache.spec.dtype != owner.dtype)  # (fp8 KV: another backend)
    if changes or owner_changed:
        raise ValueError("weights_from: a runner sharing weights cannot use "
                         f"{', '.join(changes) or 'a model its owner changed (TP, LoRA, fp8 KV)'}.")


@dataclasses.dataclass(slots=True)
class PendingStep:
    """A step the driver ran its pipeline stage of (``ModelRunner.submit``): its entries, its
    inputs, and the posted receive of its logits (None: it samples nothing)."""

    scheduled: list[ScheduledRequest]
    inputs: ModelInput
    logits: PendingLogits | None


class ModelRunner:
    """Holds the model, its KV cache, the tokenizer and per-request sampling generators.

    The engine's arguments are resolved by ``core.engine_config.resolve_engine_config`` for this
    device (``engine_config``), as the twin resolves them for its hardware profile. On CUDA the
    KV budget is what remains after the weights and a profiled forward pass of
    ``max_num_batched_tokens``, so the arguments are resolved again once that is measured.

    ``weights_from``: run on the weights another runner of the same model loaded (its own KV
    cache and limits beside them): two loads of the same weights run the same steps a few %
    apart (docs/fidelity.md, "Model loads"), so a replay compared with a calibration runs on the
    calibration's."""

    def __init__(self, args: EngineArgs, usage_context: str = "llm",
                 weights_from: ModelRunner | None = None) -> None:
        self.model_dir, self.gguf_file = resolve_model_source(args.model)
        self.quantization = resolve_quantization(args.quantization, args.model,
                                                 quantization_config(self.model_dir))
        # the method found in the file (a .gguf, a checkpoint's quantization_config) resolves
        # the engine's arguments as one given by name would (its dtype on a CPU)
        args = dataclasses.replace(args, quantization=self.quantization)
        self.config = ModelConfig.from_dir(self.model_dir)
        self.device = resolve_device(args.device)
        self.block_size = args.block_size
        self.enforce_eager = args.enforce_eager
        self.kernels = args.kernel_settings()
        platform = current_platform(self.device)
        resolved = resolve_engine_config(args, self.config, platform, usage_context)
        self.dtype = TORCH_DTYPES[resolved.dtype]
        self.max_model_len = resolved.max_model_len
        self.vocab_size = self.config.vocab_size
        profile = (self.device.type == "cuda" and args.kv_cache_memory_bytes is None
                   and args.num_gpu_blocks_override is None)
        if weights_from is not None:  # refused before any TP worker starts
            check_shareable(weights_from, self, args)
        # tensor parallelism: workers (ranks 1..) start first, load beside the driver (rank 0)
        self.tp: TPDriver | None = None
        if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
            check_tensor_parallel(args, self.config, self.quantization)
            self.tp = TPDriver(args, str(self.model_dir), resolved.dtype, self.device,
                               self.max_model_len,
                               resolved.scheduler.max_num_batched_tokens if profile else 0)
        try:
            self._load(args, resolved, platform, usage_context, profile, weights_from)
        except BaseException:
            if self.tp is not None:
                self.tp.shutdown()
            raise

    def _load(self, args: EngineArgs, resolved: EngineConfig, platform: Platform,
              usage_context: str, profile: bool, weights_from: ModelRunner | None) -> None:
        tp_group = None if self.tp is None else self.tp.group
        self.model = (weights_from.model if weights_from is not None else
                      load_model(self.model_dir, self.dtype, self.device, self.max_model_len,
                                 tp_group, self.quantization, self.gguf_file, self.kernels))
        if profile:
            from twinserve.gpu.worker.cuda_graphs import profile_peak_memory
            peak = profile_peak_memory(self.model, resolved.scheduler.max_num_batched_tokens,
                                       self.block_size, self.max_model_len)
            resolved = resolve_engine_config(args, self.config, platform, usage_context, peak)
        if self.tp is not None:
            self.tp.wait_ready()
        self.engine_config = resolved
        self.tokenizer = (Tokenizer.from_dir(self.model_dir)
                          if (self.model_dir / "tokenizer.json").is_file() else None)
        self.eos_token_id = self._eos_token_id()
        self.generator = torch.Generator(device=self.device).manual_seed(args.seed)
        self._generators: dict[str, torch.Generator] = {}
        self._structured: StructuredOutputs | None = None  # made for the first constrained one
        self._prompt_logprobs = PromptLogprobsCollector()
        self._spec: SpecStep | None = None  # speculative decoding (configure_speculation)
        spec = args.speculation
        if spec is not None:  # (imported here: the draft model proposer holds a ModelRunner)
            from twinserve.gpu.spec_decode.factory import build_proposer, verify_settings
            self.configure_speculation(build_proposer(spec, args, self.vocab_size, usage_context),
                                       verify_settings(spec))
        kv_dtype = self.dtype
        if args.kv_cache_dtype != "auto":  # fp8 (e4m3): the backend quantizes and widens
            kv_dtype = use_fp8_kv_cache(self.model, self.dtype, self.device, self.tp is not None)
        spec = kv_cache_spec(self.config, self.block_size, kv_dtype, args.tensor_parallel_size,
                             self.model.layer_range[1] - self.model.layer_range[0])  # (its stage's)
        sched = resolved.scheduler
        # the scheduler's KV cache groups (one unless a mixed model runs the hybrid layout)
        self.kv_layout = kv_cache_layout_of(self.config, args.disable_sliding_window,
                                            bool(sched.kv_cache_group_windows))
        # the Peer connector's worker owns the device blocks (a shared region), so it comes
        # first; the host tier's works over the cache once made
        kv_transfer = resolved.kv_transfer_config
        host_tier = kv_transfer is not None and kv_transfer.kv_connector == OFFLOADING_CONNECTOR
        self.kv_connector: PeerConnectorWorker | OffloadingConnectorWorker | None
        self.kv_connector = connector_for_runner(  # (gpu/kv_transfer: P/D's worker side)
            None if host_tier else kv_transfer, spec, self.kv_layout.slots_per_block, sched.num_gpu_blocks,
            self.device, {"tensor or pipeline parallelism": self.tp is not None,
                          "a hybrid KV cache layout": self.kv_layout.num_groups > 1})
        self.kv_cache = KVCache(spec, sched.num_gpu_blocks, sched.num_cpu_blocks, self.device,
                                self.kv_layout if args.pipeline_parallel_size == 1 else None,
                                self.kv_connector and self.kv_connector.region.slots())  # type: ignore[union-attr]
        if self.tp is not None:
            self.tp.allocate_kv_cache(sched.num_gpu_blocks, sched.num_cpu_blocks)
        if host_tier:
            self.kv_connector = offloading_worker_for(  # (gpu/kv_offload: the host tier)
                kv_transfer, self.kv_cache, {"tensor or pipeline parallelism": self.tp is not None})
        self.num_gpu_blocks = self.kv_cache.num_gpu_blocks
        self.num_cpu_blocks = self.kv_cache.num_cpu_blocks
        self.lora: LoRAManager | None = None
        lora_config = args.lora_config()
        if lora_config is not None:
            self.lora = LoRAManager(self.model, self.config, lora_config,
                                    use_triton=self.device.type == "cuda")
        self._graphs = None
        # the decode graphs capture one block table: hybrid layouts run eagerly; so do models
        # whose embedding is quantized (its lookup checks the ids on the host)
        if self.device.type == "cuda" and not args.enforce_eager and args.pipeline_parallel_size == 1 and \
                self.kv_layout.num_groups == 1 and \
                getattr(self.model, "quant_embed", None) is None:
            from twinserve.gpu.worker.cuda_graphs import DecodeGraphs
            # uniform verifications of k_max drafts too (not under tensor parallelism: the
            # workers' graphs hold decodes only, and collectives must run alike on every rank)
            verify_ks = ((args.speculation.num_speculative_tokens,)
                         if args.speculation is not None and self.tp is None else ())
            self._graphs = DecodeGraphs(self.model, self.kv_cache.gpu, self.block_size,
                                        self.max_model_len, verify_ks)
        tune_cpu_gemm(self)  # (times decode steps: once the cache and the rest are set up)

    def _eos_token_id(self) -> int | None:
        eos = load_generation_config(self.model_dir).get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is None and self.config.eos_token_ids:
            eos = self.config.eos_token_ids[0]
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return eos

    def configure_speculation(self, proposer: Proposer, settings: VerifySettings) -> None:
        """Verifies drafts with ``settings`` and asks ``proposer`` for the next steps' drafts."""
        self._spec = SpecStep(proposer, settings)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        connector, meta = self.kv_connector, scheduler_output.kv_connector_metadata
        if connector is not None and meta is not None:  # loads before/beside, stores after
            connector.start(meta)
            out = self._execute(scheduler_output, None)
            out.kv_connector_output = connector.get_finished()
            return out
        if self.tp is None:
            return self._execute(scheduler_output, None)
        with self.tp.guard():  # a dead or hung rank: WorkerFailure naming it
            inputs = self.tp.send_step(scheduler_output, self.block_size, self.max_model_len)
            return self._execute(scheduler_output, inputs)

    def shutdown(self) -> None:
        """Ends the tensor-parallel workers (also done at exit and when the runner is dropped)
        and the KV connector's threads or copies."""
        if getattr(self, "kv_connector", None) is not None:  # (None: no connector, or not loaded)
            self.kv_connector.close()
        if self.tp is not None:
            self.tp.shutdown()

    @property
    def can_queue_batches(self) -> bool:
        """Whether steps may overlap in the pipeline (``submit``/``finish``): pipeline
        parallelism, without speculative decoding (a verification's drafts come from the step
        before it)."""
        pp = getattr(self.model, "pipeline", None)
        return pp is not None and pp.layout.pp_size > 1 and self._spec is None

    def submit(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """The batch queue's first half of ``execute`` (pipeline parallelism): the step to every
        worker, the driver's stage of the forward pass, the receive of its logits posted;
        ``finish`` samples them. A batch with tokens only."""
        assert self.tp is not None
        with self.tp.guard(), torch.inference_mode():
            inputs = self.tp.send_step(scheduler_output, self.block_size, self.max_model_len)
            scheduled, inputs, _ = self._forward_step(scheduler_output, inputs)
            rows = int(inputs.sample_rows.numel()) if inputs.sample_index else 0
            return PendingStep(scheduled, inputs, self.tp.submitted(rows, self.vocab_size))

    def finish(self, pending: PendingStep) -> ModelRunnerOutput:
        """The batch's logits (the last stage's), sampled: its ``ModelRunnerOutput``."""
        assert self.tp is not None
        with self.tp.guard(), torch.inference_mode():
            logits = self.tp.finished(pending.logits)
            out = ModelRunnerOutput()
            if logits is None:
                return out
            return self._sample(pending.scheduled, pending.inputs, logits, None, out)

    @torch.inference_mode()
    def _execute(self, scheduler_output: SchedulerOutput,
                 prepared: ModelInput | None) -> ModelRunnerOutput:
        if not scheduler_output.scheduled:
            self._begin_step(scheduler_output)
            return ModelRunnerOutput()
        scheduled, inputs, hidden = self._forward_step(scheduler_output, prepared)
        out = ModelRunnerOutput()
        if scheduler_output.num_prefill_tokens and any(
                sr.request.sampling_params.prompt_logprobs is not None for sr in scheduled):
            out.prompt_logprobs = self._prompt_logprobs.collect(scheduled, hidden,
                                                                self.model.compute_logits)
        if not inputs.sample_index:
            return out
        if inputs.sample_counts:
            return self._sample_verifying(scheduled, inputs, hidden, out)
        last_hidden = hidden[inputs.sample_rows]
        return self._sample(scheduled, inputs, self.model.compute_logits(last_hidden), last_hidden,
                            out)

    def _begin_step(self, scheduler_output: SchedulerOutput) -> None:
        """What precedes the forward pass: finished requests forgotten, blocks moved, adapters
        loaded."""
        for request_id in scheduler_output.finished_request_ids:
            self._generators.pop(request_id, None)
        if self._structured is not None:
            self._structured.free(scheduler_output.finished_request_ids)
        self._prompt_logprobs.free(scheduler_output.finished_request_ids)
        if self._spec is not None:
            self._spec.proposer.on_finished(scheduler_output.finished_request_ids)
        self.kv_cache.swap_out(scheduler_output.blocks_to_swap_out)
        self.kv_cache.swap_in(scheduler_output.blocks_to_swap_in)
        self.kv_cache.copy_blocks(scheduler_output.blocks_to_copy)
        if self.lora is not None:
            self.lora.load_slots(scheduler_output.lora_loads)

    def _forward_step(self, scheduler_output: SchedulerOutput, prepared: ModelInput | None
                      ) -> tuple[list[ScheduledRequest], ModelInput, torch.Tensor]:
        """``_begin_step``, then the forward pass over a step with tokens: its entries (grouped
        by adapter), inputs and final hidden states."""
        self._begin_step(scheduler_output)
        lora = self.lora
        scheduled = scheduler_output.scheduled
        if lora is not None:
            scheduled = lora.group_by_adapter(scheduled)
        inputs = prepared or build_model_input(scheduled, self.block_size, self.max_model_len,
                                               self.device, self.kv_layout)
        if lora is not None:
            lora.begin_step(scheduled)
        try:
            hidden = self._forward(inputs)
        finally:
            if lora is not None:
                lora.end_step()
        return scheduled, inputs, hidden

    def _sample(self, scheduled: list[ScheduledRequest], inputs: ModelInput, logits: torch.Tensor,
                last_hidden: torch.Tensor | None, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """One token per sampling row from ``logits`` (``last_hidden``: the rows' hidden states,
        for embedding requests; None under the batch queue, which serves none)."""
        requests = [scheduled[i].request for i in inputs.sample_index]
        structured = self._structured_outputs(requests)
        allowed = structured.bitmask(requests) if structured is not None else None
        result = sample(logits, requests, [self._generator_for(r) for r in requests],
                        self.generator, allowed)
        if allowed is not None:
            structured.advance(requests, result.token_ids)
        for row, (request, token, logprobs) in enumerate(
                zip(requests, result.token_ids, result.logprobs)):
            out.sampled_token_ids[request.request_id] = [token]
            if logprobs is not None:
                out.logprobs[request.request_id] = [logprobs]
            if request.pooling_params is not None and last_hidden is not None:  # its last prompt
                out.pooled[request.request_id] = pooled_state(last_hidden[row],
                                                              request.pooling_params)
        if self._spec is not None:
            self._spec.propose(scheduled, inputs.sample_index, out)
        return out

    def _sample_verifying(self, scheduled: list[ScheduledRequest], inputs: ModelInput,
                          hidden: torch.Tensor, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """A step with verification entries: logits at every drafted position."""
        if self._spec is None:
            raise ValueError("a step verifies drafts but the runner has no speculative_config.")
        sampled_hidden = hidden[inputs.sample_rows]
        logits = self.model.compute_logits(sampled_hidden)
        entries = [scheduled[i] for i in inputs.sample_index]
        row = 0
        for sr, count in zip(entries, inputs.sample_counts):
            if sr.request.pooling_params is not None:  # one row: its last prompt position
                out.pooled[sr.request_id] = pooled_state(sampled_hidden[row],
                                                         sr.request.pooling_params)
            row += count
        requests = [sr.request for sr in entries]
        structured = self._structured_outputs(requests)
        self._spec.sample(entries, inputs.sample_counts, logits, structured,
                          [self._generator_for(r) for r in requests], self.generator, out)
        self._spec.propose(scheduled, inputs.sample_index, out)
        return out

    @torch.inference_mode()
    def sample_logits(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """One forward pass over ``scheduled`` (no swaps, LoRA or sampling): the float32
        logits at every sampling row (all 1 + k rows of a verification entry). For a runner
        driven by another, as a draft model's is."""
        inputs = build_model_input(scheduled, self.block_size, self.max_model_len, self.device,
                                   self.kv_layout)
        return self.model.compute_logits(self._forward(inputs)[inputs.sample_rows]).float()

    def _forward(self, inputs: ModelInput) -> torch.Tensor:
        # A step with adapter rows runs eagerly: the decode graphs hold the base product only.
        graphs_ok = self.lora is None or self.lora.context.batch is None
        if self._graphs is not None and graphs_ok and self._graphs.can_run(inputs):
            return self._graphs.run(inputs)
        self.model.backend.prepare(inputs.meta, self.block_size)
        return self.model(inputs.input_ids, inputs.positions, self.kv_cache.gpu, inputs.meta)

    def _structured_outputs(self, requests: list[Request]) -> StructuredOutputs | None:
        """The runner's matchers, made when the first constrained request samples."""
        if self._structured is None and any(
                r.sampling_params.structured_outputs is not None for r in requests):
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer.json.")
            self._structured = StructuredOutputs(self.model_dir / "tokenizer.json",
                                                 self.vocab_size, self.eos_token_id)
        return self._structured

    def prefetch_grammar(self, request: Request) -> None:
        """Starts compiling a new request's grammar off the step (``StructuredOutputs``)."""
        so = request.sampling_params.structured_outputs
        structured = self._structured_outputs([request]) if so is not None else None
        if so is not None and structured is not None:
            structured.prefetch(so)

    def take_dead_ends(self) -> list[str]:
        """Constrained requests whose grammar reached a dead end since the last call."""
        return self._structured.take_dead_ends() if self._structured is not None else []

    def _generator_for(self, request: Request) -> torch.Generator | None:
        """A seeded request's own generator (seed + child index for n > 1), made on first use."""
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.greedy:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed + request.index)
            self._generators[request.request_id] = gen
        return gen
