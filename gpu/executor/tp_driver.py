"""Rank 0 of a tensor-parallel group (and of the first pipeline stage): the engine process
itself, which also computes.

The driver computes (as vLLM's ``mp`` executor does) rather than only coordinating: the scheduler,
the sampler and every per-request state (generators, grammars, LoRA slots) then stay in the engine
process exactly as without TP, and only the forward pass is replicated across processes. The cost is
that the driver blocks inside a collective when a worker fails; the group's timeout and the gloo /
NCCL errors on a dead peer bound that wait, and ``guard`` turns it into a ``WorkerFailure`` naming
the rank, after which every worker is ended.

Pipeline parallelism (``gpu/distributed/pipeline.py``) runs over the same workers and messages:
the world is ``tp * pp`` ranks, every rank receives every step's inputs, and the stages meet in
their point-to-point sends instead of (besides) the collectives; the driver's forward ends at its
stage and its ``compute_logits`` receives the last stage's logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from twinserve.core.engine_args import EngineArgs
from twinserve.core.model_config import ModelConfig
from twinserve.core.outputs import SchedulerOutput
from twinserve.gpu.distributed.parallel_state import (
    GroupAddress,
    TPGroup,
    backend_for,
    destroy_tp_group,
    host_store,
)
from twinserve.gpu.distributed.pipeline import (
    PendingLogits,
    init_parallel_groups,
    stage_layer_range,
)
from twinserve.gpu.executor.executor_base import Executor, WorkerFailure, make_executor
from twinserve.gpu.executor.shard_worker import ShardSpec, ShardStep, inputs_to, threads_per_rank
from twinserve.gpu.layers.linear import check_heads_divisible
from twinserve.gpu.worker.batch import ModelInput, build_model_input

START_TIMEOUT_S = 600.0  # loading a shard of a large checkpoint takes minutes
# How long any rank waits for another in a collective (and to join the group): past it a hung
# rank fails the step. Not an engine argument (no setting serves better than a generous bound);
# the tests shorten it by patching this constant.
COLLECTIVE_TIMEOUT_S = 120.0


def check_tensor_parallel(args: EngineArgs, config: ModelConfig,
                          quantization: str | None = None) -> None:
    """What tensor and pipeline parallelism cannot serve, refused before any worker starts."""
    tp = args.tensor_parallel_size
    if args.pipeline_parallel_size > 1:
        check_pipeline_parallel(args, config)
    if quantization is not None:
        raise ValueError(f"quantization={quantization!r} with tensor_parallel_size > 1 is not "
                         "implemented (the quantized layers hold whole weights).")
    check_heads_divisible(config.num_attention_heads, config.num_key_value_heads, tp)
    for name, size in (("intermediate_size", config.intermediate_size),
                       ("hidden_size", config.hidden_size)):
        if size % tp:
            raise ValueError(f"{name} ({size}) must be divisible by tensor parallel size ({tp}).")
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        raise ValueError(f"kv_cache_dtype={args.kv_cache_dtype!r} with tensor_parallel_size > 1 "
                         "is not implemented.")
    if args.enable_lora:
        raise ValueError("enable_lora with tensor_parallel_size > 1 is not implemented "
                         "(LoRA runs on one rank only).")


def check_pipeline_parallel(args: EngineArgs, config: ModelConfig) -> None:
    """What the pipeline stages cannot serve, named."""
    pp = args.pipeline_parallel_size
    # (at least one layer per stage, and a partition that sums to the model's layers)
    stage_layer_range(config.num_hidden_layers, pp, 0, args.layer_partition())
    if len({config.layer_window(i) for i in range(config.num_hidden_layers)}) > 1:
        raise ValueError("pipeline_parallel_size > 1 with a model mixing sliding-window and full "
                         "layers is not implemented.")


class TPDriver:
    """Starts the workers, joins the group as rank 0, and sends them every step."""

    def __init__(self, args: EngineArgs, model_dir: str, dtype: str, device: torch.device,
                 max_model_len: int, profile_tokens: int = 0) -> None:
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        if pp > 1 and profile_tokens > 0:
            raise ValueError("pipeline_parallel_size > 1 on CUDA needs kv_cache_memory_bytes or "
                             "num_gpu_blocks_override (profiling memory across stages is not "
                             "implemented).")
        world = tp * pp
        timeout = self.timeout_s = COLLECTIVE_TIMEOUT_S
        torch.set_num_threads(threads_per_rank(world))
        self.device = device
        self._store = host_store(world, START_TIMEOUT_S)
        address = GroupAddress("127.0.0.1", self._store.port, world, backend_for(device), timeout)
        # (decode graphs would capture the stages' sends: pipeline stages run eagerly)
        spec = ShardSpec(model_dir, dtype, device.type, max_model_len, args.block_size, address,
                         threads_per_rank(world), args.enforce_eager or pp > 1, profile_tokens,
                         args.kernel_settings(), tp, args.layer_partition())
        num_layers = ModelConfig.from_dir(model_dir).num_hidden_layers
        self.executor: Executor = make_executor(args.distributed_executor_backend or "mp", spec)
        self.group: TPGroup | None = None
        self.error: str | None = None
        # The batch queue's batches in the pipeline now, and the most there ever were at once.
        self.batches_in_flight = 0
        self.max_batches_in_flight = 0
        try:
            self.executor.wait_joining(START_TIMEOUT_S)
            self.group = init_parallel_groups(address, 0, device, tp, num_layers, self._store,
                                              args.layer_partition())
        except RuntimeError as exc:  # a worker that failed between "joining" and joining
            reason = None if isinstance(exc, WorkerFailure) else self.executor.failure(2.0)
            self.shutdown()
            if reason is not None:
                raise WorkerFailure(reason) from exc
            raise
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        self.executor.wait_ready(START_TIMEOUT_S)

    def allocate_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.executor.allocate_kv_cache(num_gpu_blocks, num_cpu_blocks)

    def send_step(self, out: SchedulerOutput, block_size: int,
                  max_model_len: int) -> ModelInput | None:
        """The step to every worker; returns the inputs, on the driver's device."""
        if self.error is not None:
            raise WorkerFailure(f"the tensor-parallel group is down: {self.error}")
        host = torch.device("cpu")
        inputs = (build_model_input(out.scheduled, block_size, max_model_len, host)
                  if out.scheduled else None)
        step = ShardStep(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy, inputs)
        if inputs is not None or step.blocks_to_swap_out or step.blocks_to_swap_in \
                or step.blocks_to_copy:
            self.executor.send_step(step)
        return None if inputs is None else inputs_to(inputs, self.device)

    def submitted(self, num_rows: int, vocab_size: int) -> PendingLogits | None:
        """A batch entered the pipeline (the driver ran its stage): counts it, and posts the
        receive of its ``num_rows`` logits (None: it samples nothing)."""
        links = None if self.group is None else self.group.pipeline
        if links is None:
            raise RuntimeError("submitted: the group has no pipeline links (pipeline_parallel_size 1).")
        self.batches_in_flight += 1
        self.max_batches_in_flight = max(self.max_batches_in_flight, self.batches_in_flight)
        return links.post_recv_logits(num_rows, vocab_size) if num_rows else None

    def finished(self, pending: PendingLogits | None) -> torch.Tensor | None:
        """The oldest batch's logits (waiting for them); it leaves the count."""
        self.batches_in_flight -= 1
        return None if pending is None else pending.wait()

    @contextmanager
    def guard(self) -> Iterator[None]:
        """A collective's error (a dead or hung peer) becomes a WorkerFailure naming the rank;
        the group is then ended, so every later step fails at once."""
        try:
            yield
        except WorkerFailure:
            raise
        except KeyboardInterrupt:  # the ranks may stand at different collectives now
            self.error = "a step was interrupted (Ctrl-C); the workers were ended"
            self.shutdown()
            raise
        except RuntimeError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            reason = self.executor.failure(timeout_s=2.0) or (
                f"tensor-parallel workers {self.executor.worker_pids()} are alive but a "
                f"collective failed within the {self.timeout_s:.0f} s timeout: a rank is "
                f"hung ({first})")
            self.error = reason
            self.shutdown()
            raise WorkerFailure(reason) from exc

    def worker_pids(self) -> list[int]:
        return self.executor.worker_pids()

    def shutdown(self) -> None:
        if self.group is not None:
            destroy_tp_group(self.group)
        self.executor.shutdown()
