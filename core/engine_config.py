"""``EngineArgs`` resolved for one model on one device: the one function both halves call.

    resolve_engine_config(args, model, platform, usage_context, non_kv_bytes) -> EngineConfig

The real engine describes its own device (``gpu.platform.current_platform``); the twin describes
the device of its hardware profile (``HardwareProfile.platform``). Given the same description
both get the same scheduler settings, block counts and dtype, by construction:

- batch limits: vLLM's defaults per device and usage context (``default_batch_limits``);
- dtype: ``auto`` is the checkpoint's half dtype on CUDA; on a CPU bfloat16 only where the
  processor has native bf16 matmuls, else float32 (exact to the checkpoint);
- ``max_model_len``: the model's limit unless lower; above it is an error, worded as vLLM's;
- KV blocks: the KV byte budget over one block's bytes (per tensor-parallel rank; a block spans
  the layers of one KV cache group, all of them unless the model mixes sliding and full layers:
  ``core/kv_cache_groups.py``). On a CPU the
  budget is ``kv_cache_memory_bytes`` (default 2 GiB) within half the memory available; on a GPU
  ``total * gpu_memory_utilization`` minus what weights and activations take (``non_kv_bytes``:
  measured by the real engine, estimated by the twin). Host blocks come from ``swap_space``.
  A sequence must fit the cache: the model's limit is capped to it (with a warning), an explicit
  ``max_model_len`` that does not fit is an error;
- admission (``usage_context="server"``): at most ``4 x max_num_seqs`` requests and ``4 x`` the
  cache's tokens of prompts wait unadmitted; offline (``llm``) use queues without bound.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from twinserve.core.config import SchedulerConfig
from twinserve.core.engine_args import EngineArgs
from twinserve.core.kv_cache_groups import KVCacheLayout, layout_for_model
from twinserve.core.kv_offload import num_host_blocks, offloading_config
from twinserve.core.kv_transfer_config import KVTransferConfig
from twinserve.core.model_config import DTYPE_BYTES, ModelConfig
from twinserve.core.quantization import kv_value_bytes

GIB = 1 << 30
USAGE_CONTEXTS = ("llm", "server")
DEFAULT_CPU_KV_CACHE_BYTES = 2 * GIB
# A server's default admission bounds: requests and prompt tokens queued (not yet admitted)
# beyond which new requests get "not now" (503) instead of an unbounded wait.
WAITING_REQUESTS_PER_SEQ = 4
WAITING_TOKENS_PER_KV_TOKEN = 4
logger = logging.getLogger("twinserve.engine")


@dataclass(slots=True, frozen=True)
class Platform:
    """A device as the configuration sees it. ``memory_bytes``: a GPU's total memory, or the host
    memory available to a CPU engine."""

    device_type: str  # "cpu" or "cuda"
    device_name: str
    memory_bytes: int
    native_bf16: bool = True

    def __post_init__(self) -> None:
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be cpu or cuda, got {self.device_type!r}.")
        if self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive, got {self.memory_bytes}.")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """What an engine runs with: the arguments as given, and every value resolved from them."""

    args: EngineArgs
    usage_context: str
    device_type: str
    device_name: str
    dtype: str
    kv_cache_bytes: int
    block_bytes: int
    scheduler: SchedulerConfig
    # The KV connector the engine runs: ``args.kv_transfer_config``, or the OffloadingConnector
    # that ``kv_offloading_size`` stands for, sized in blocks of this layout (None: none).
    kv_transfer_config: KVTransferConfig | None = None

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def to_dict(self) -> dict[str, Any]:
        """Flat, for a run folder's ``config.json``: the arguments with their resolved values."""
        scheduler = asdict(self.scheduler)
        if not self.args.enable_lora:  # 0 slots is how the scheduler says "no LoRA"
            del scheduler["max_loras"]
        args = asdict(self.args)
        del args["kv_transfer_config"]  # recorded only where a connector runs, as resolved
        if self.args.kv_offloading_size is None:
            del args["kv_offloading_size"], args["kv_offloading_backend"]
        out = {**args, **scheduler, "usage_context": self.usage_context,
               "device_type": self.device_type, "device_name": self.device_name,
               "dtype": self.dtype, "kv_cache_bytes": self.kv_cache_bytes,
               "block_bytes": self.block_bytes}
        if self.args.kv_offloading_size is not None:  # the connector it stands for, sized
            assert self.kv_transfer_config is not None
            out["kv_offloading_blocks"] = self.kv_transfer_config.kv_connector_extra_config[
                "num_cpu_blocks"]
        elif self.kv_transfer_config is not None:  # (a rerun rebuilds it from these keys)
            out["kv_transfer_config"] = self.kv_transfer_config.to_dict()
        return out


def default_batch_limits(platform: Platform, usage_context: str,
                         world_size: int = 1) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` as vLLM defaults them (``EngineArgs.
    get_batch_defaults``): large GPUs (70+ GiB, not an A100) get bigger budgets; offline use
    (``llm``) gets larger steps than a server, whose steps bound every stream's latency."""
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got {usage_context!r}.")
    offline = usage_context == "llm"
    if platform.device_type == "cpu":
        return (4096 if offline else 2048) * world_size, (256 if offline else 128) * world_size
    if platform.memory_bytes >= 70 * GIB and "a100" not in platform.device_name.lower():
        return (16384 if offline else 8192), 1024
    return (8192 if offline else 2048), 256


def resolve_dtype(requested: str, checkpoint: str | None, platform: Platform,
                  quantization: str | None = None) -> str:
    if requested != "auto":
        return requested
    if platform.device_type == "cuda":
        return checkpoint if checkpoint in ("bfloat16", "float16") else "bfloat16"
    if quantization is not None:
        # quantized products compute in float32 and the fused decode step runs in float32 only,
        # so float32 is the faster dtype for them even with native bf16 (docs/cpu-backend.md)
        return "float32"
    return "bfloat16" if platform.native_bf16 else "float32"


def resolve_max_model_len(requested: int | None, model: ModelConfig,
                          disable_sliding_window: bool = False) -> int:
    limit = model.max_position_embeddings
    if limit is None:
        raise ValueError("config.json has no max_position_embeddings: pass max_model_len.")
    windows = [w for w in (model.layer_window(i) for i in range(model.num_hidden_layers))
               if w is not None]
    if disable_sliding_window and windows and min(windows) < limit:
        # as vLLM: within the smallest window full attention is exact
        if requested is not None and requested > min(windows):
            raise ValueError(f"max_model_len={requested} exceeds the sliding window "
                             f"({min(windows)}) that disable_sliding_window caps it to.")
        limit = min(windows)
    limit = _longrope_limit(requested, model, limit)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"User-specified max_model_len ({requested}) is greater than the derived "
                         f"max_model_len (max_position_embeddings={limit} in the model's "
                         "config.json). twinserve does not serve past the model's trained "
                         "length: pass max_model_len <= " f"{limit}.")
    return requested


def _longrope_limit(requested: int | None, model: ModelConfig, limit: int) -> int:
    """longrope (Phi-3) is served within ``original_max_position_embeddings``, where HF's
    frequencies are the short factors for every sequence. Past it HF switches per forward pass
    by the sequence's length (a prompt longer than that is rotated with the long factors
    throughout; a shorter one switches at that position while its cached keys keep the short
    rotation), which one table per engine (vLLM's choice: the long factors whenever
    max_model_len exceeds the original length) does not reproduce for shorter sequences; so a
    longer max_model_len is refused, naming the setting."""
    scaling = model.rope_scaling
    if scaling is None or scaling.get("rope_type") != "longrope":
        return limit
    original = int(scaling["original_max_position_embeddings"])
    if original >= limit:
        return limit
    if requested is not None and requested > original:
        raise ValueError(
            f"max_model_len={requested} exceeds longrope's original_max_position_embeddings "
            f"({original}): past it HF rotates each sequence by its own length (short or long "
            "factors), which twinserve does not reproduce; serve with max_model_len <= "
            f"{original}.")
    if requested is None:
        logger.warning("max_model_len capped from %d to %d: longrope is served within its "
                       "original_max_position_embeddings (the short factors, as HF there).",
                       limit, original)
    return original


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: str,
                   tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                   num_layers: int | None = None) -> int:
    """Keys and values of one block across ``num_layers`` layers (all by default; a hybrid
    layout's block spans one group's ``slots_per_block``), on one rank (KV heads are split across
    ranks and replicated when there are fewer of them than ranks); an fp8 cache stores one byte
    per value."""
    heads = max(1, model.num_key_value_heads // tensor_parallel_size)
    value_bytes = kv_value_bytes(kv_cache_dtype, DTYPE_BYTES[dtype])
    layers = model.num_hidden_layers if num_layers is None else num_layers
    return 2 * layers * block_size * heads * model.head_dim * value_bytes


def kv_cache_layout_of(model: ModelConfig, disable_sliding_window: bool = False,
                       hybrid: bool = True) -> KVCacheLayout:
    """The model's KV cache groups: one unless it mixes sliding-window and full layers (then
    vLLM's hybrid groups, unless ``hybrid`` is off: one group in which every layer keeps every
    block, attention unchanged, as vLLM's ``disable_hybrid_kv_cache_manager``)."""
    layout = layout_for_model(model.num_hidden_layers, model.layer_window, disable_sliding_window)
    if layout.num_groups > 1 and not hybrid:
        return layout_for_model(model.num_hidden_layers, model.layer_window, True)
    return layout


def hybrid_kv_cache_supported(args: EngineArgs) -> bool:
    """Where the engine runs the hybrid layout: unless disabled, and not yet with tensor
    parallelism (the workers' caches and step inputs carry one block table) nor with an fp8
    cache (its compacted tables); there a mixed model keeps every block in every layer."""
    return (not args.disable_hybrid_kv_cache_manager and args.tensor_parallel_size == 1
            and args.kv_cache_dtype == "auto")


def sequence_kv_tokens(layout: KVCacheLayout, num_blocks: int, block_size: int,
                       max_chunk: int) -> int:
    """The longest sequence ``num_blocks`` hold. One group: every block's tokens. Hybrid: the
    full groups hold the sequence, each sliding group its window and one chunk
    (``KVCacheManager.max_blocks_held``), one block is the null block."""
    if layout.num_groups == 1:
        return num_blocks * block_size
    usable = num_blocks - 1
    caps = [-(-(w - 1 + max_chunk) // block_size) + 1
            for w in layout.group_windows if w is not None]
    every = usable // layout.num_groups  # while every group holds the whole sequence
    if every <= min(caps):
        return every * block_size
    full = layout.num_groups - len(caps)
    return max(0, (usable - sum(caps)) // full) * block_size


def kv_cache_budget(args: EngineArgs, platform: Platform, non_kv_bytes: int) -> int:
    if platform.device_type == "cpu":
        wanted = args.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        return min(wanted, platform.memory_bytes // 2)
    if args.kv_cache_memory_bytes is not None:
        return args.kv_cache_memory_bytes
    return int(platform.memory_bytes * args.gpu_memory_utilization) - non_kv_bytes


def resolve_engine_config(args: EngineArgs, model: ModelConfig, platform: Platform,
                          usage_context: str = "llm", non_kv_bytes: int = 0) -> EngineConfig:
    """Resolves ``args`` for ``model`` on ``platform``. Raises ValueError for a configuration
    that cannot run (saying what to change)."""
    tp = args.tensor_parallel_size
    lora = args.lora_config()
    batched, seqs = default_batch_limits(platform, usage_context, tp)
    dtype = resolve_dtype(args.dtype, model.torch_dtype, platform,
                          args.quantization or model.quantization)
    max_len = resolve_max_model_len(args.max_model_len, model, args.disable_sliding_window)
    max_batched = args.max_num_batched_tokens or batched
    hybrid = hybrid_kv_cache_supported(args)
    layout = kv_cache_layout_of(model, args.disable_sliding_window, hybrid)
    if not hybrid and not args.disable_hybrid_kv_cache_manager and \
            kv_cache_layout_of(model, args.disable_sliding_window).num_groups > 1:
        logger.warning("%s mixes sliding-window and full layers; with tensor parallelism or an "
                       "fp8 KV cache every layer keeps every block (no hybrid KV cache).",
                       model.name)
    block_bytes = kv_block_bytes(model, args.block_size, dtype, tp, args.kv_cache_dtype,
                                 layout.slots_per_block)
    budget = kv_cache_budget(args, platform, non_kv_bytes)
    num_blocks = budget // block_bytes if budget > 0 else 0
    if args.num_gpu_blocks_override is not None:
        num_blocks = args.num_gpu_blocks_override
    if num_blocks <= 0:
        raise _no_room(platform, args, non_kv_bytes)
    chunk = max_batched if args.enable_chunked_prefill else max_len
    kv_tokens = sequence_kv_tokens(layout, num_blocks, args.block_size, chunk)
    max_len = _fit_max_model_len(args, max_len, kv_tokens)
    model.check_servable(max_len)  # what the model's attention can honour
    if not args.enable_chunked_prefill:
        max_batched = max(max_batched, max_len)
    max_seqs = args.max_num_seqs or seqs
    waiting_requests, waiting_tokens = args.max_waiting_requests, args.max_waiting_tokens
    if usage_context == "server":  # a server says "not now" rather than queue without bound
        waiting_requests = waiting_requests or WAITING_REQUESTS_PER_SEQ * max_seqs
        waiting_tokens = waiting_tokens or WAITING_TOKENS_PER_KV_TOKEN * kv_tokens
    scheduler = SchedulerConfig(
        num_gpu_blocks=num_blocks, block_size=args.block_size,
        max_num_seqs=max_seqs, max_num_batched_tokens=max_batched,
        max_model_len=max_len, enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching, prefill_first=args.prefill_first,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        preemption_mode=args.preemption_mode,
        num_cpu_blocks=int(args.swap_space * GIB) // block_bytes,
        max_waiting_requests=waiting_requests, max_waiting_tokens=waiting_tokens,
        max_loras=lora.max_loras if lora is not None else 0,
        sliding_window=None if args.disable_sliding_window else model.kv_sliding_window,
        kv_cache_group_windows=layout.group_windows if layout.num_groups > 1 else (),
        **_speculation_fields(args))
    return EngineConfig(args, usage_context, platform.device_type, platform.device_name, dtype,
                        num_blocks * block_bytes, block_bytes, scheduler,
                        resolve_kv_transfer_config(args, block_bytes, scheduler))


def resolve_kv_transfer_config(args: EngineArgs, block_bytes: int,
                               scheduler: SchedulerConfig) -> KVTransferConfig | None:
    """``args.kv_transfer_config``, or the host tier ``kv_offloading_size`` asks for: as vLLM,
    the shortcut sets the OffloadingConnector, here with its size in host blocks."""
    if args.kv_offloading_size is None:
        return KVTransferConfig.of(args.kv_transfer_config)  # normalized already: as typed
    blockers = [name for name, on in (
        ("a sliding window", scheduler.sliding_window is not None),
        ("a hybrid KV cache layout", bool(scheduler.kv_cache_group_windows)),
        ("enable_prefix_caching=False", not scheduler.enable_prefix_caching)) if on]
    if blockers:
        raise ValueError(f"kv_offloading_size with {', '.join(blockers)} is not implemented: the "
                         "host tier keys blocks by the prefix cache's hashes of full attention.")
    return offloading_config(num_host_blocks(args.kv_offloading_size, block_bytes))


def _speculation_fields(args: EngineArgs) -> dict[str, Any]:
    """The scheduler's speculation settings (k_max 0: off)."""
    spec = args.speculation
    if spec is None:
        return {}
    return {"num_speculative_tokens": spec.max_drafts, "speculation_policy": spec.policy}


def _fit_max_model_len(args: EngineArgs, max_len: int, kv_tokens: int) -> int:
    """A sequence must fit the KV cache: an explicit ``max_model_len`` that cannot is an error
    (as vLLM's); the model's own limit is capped to what fits, with a warning. A block count
    given by hand (``num_gpu_blocks_override``, a study's setting) is taken as it is: requests
    that cannot fit it are refused one by one."""
    if max_len <= kv_tokens or args.num_gpu_blocks_override is not None:
        return max_len
    if args.max_model_len is not None:
        raise ValueError(
            f"The model's max seq len ({max_len}) is larger than the maximum number of tokens "
            f"that can be stored in KV cache ({kv_tokens}). Try increasing "
            "kv_cache_memory_bytes or gpu_memory_utilization, or decreasing max_model_len.")
    logger.warning("max_model_len capped from %d (the model's) to %d: the KV cache holds only "
                   "%d tokens (raise kv_cache_memory_bytes or gpu_memory_utilization for more).",
                   max_len, kv_tokens, kv_tokens)
    return kv_tokens


def _no_room(platform: Platform, args: EngineArgs, non_kv_bytes: int) -> ValueError:
    return ValueError(
        f"no memory is left for the KV cache on {platform.device_name}: "
        f"{platform.memory_bytes / GIB:.1f} GiB x gpu_memory_utilization "
        f"{args.gpu_memory_utilization} minus {non_kv_bytes / GIB:.1f} GiB of weights and "
        "activations leaves less than one block. Raise gpu_memory_utilization or "
        "tensor_parallel_size, or pick a smaller model or a larger device.")
