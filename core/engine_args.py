"""The engine's arguments under vLLM's names: one set for the real engine and for its twin.

``EngineArgs`` holds what the user asked for (``None`` = "pick the default"); ``engine_config``
resolves it, for one model on one device and usage context, into what the engine runs with.
Arguments vLLM accepts that twinserve does not implement are refused by name (``ValueError``)
unless given their "absent" value, so a configuration never silently means less than it says.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from twinserve.core.kernel_settings import KernelSettings
from twinserve.core.kv_offload import check_kv_offloading
from twinserve.core.kv_transfer_config import KVTransferConfig
from twinserve.core.lora import LoRAConfig
from twinserve.core.quantization import check_kv_cache_dtype, check_quantization
from twinserve.core.speculative_config import SpeculativeConfig

PREEMPTION_MODES = ("recompute", "swap")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
EXECUTOR_BACKENDS = ("mp", "ray")  # tensor / pipeline parallelism's workers: local processes or Ray actors

# vLLM engine arguments twinserve does not implement (yet), each with the value that means
# "not used": that value is accepted, any other is refused naming the argument.
NOT_IMPLEMENTED: Mapping[str, Any] = types.MappingProxyType({
    "cpu_offload_gb": 0, "trust_remote_code": False,
    "tokenizer": None, "tokenizer_mode": "auto", "revision": None, "code_revision": None,
    "tokenizer_revision": None, "download_dir": None, "load_format": "auto",
    "hf_overrides": None, "rope_scaling": None, "rope_theta": None, "max_logprobs": 20,
    "enable_expert_parallel": False,
    "structured_outputs_config": None, "guided_decoding_backend": None,
    "enable_prompt_embeds": False, "limit_mm_per_prompt": None, "mm_processor_kwargs": None,
    "max_num_partial_prefills": 1, "scheduler_cls": None, "compilation_config": None,
    "calculate_kv_scales": False, "enable_sleep_mode": False,
})


@dataclass(slots=True)
class EngineArgs:
    """Engine knobs (vLLM's names and meanings). ``None`` fields are resolved per device and
    usage context by ``engine_config.resolve_engine_config``, as vLLM picks its defaults."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"  # the real engine: cuda when present, else cpu; the twin: its profile's
    seed: int = 0
    scheduling_policy: str = "fcfs"
    policy_options: dict[str, Any] = field(default_factory=dict)
    block_size: int = 16
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    prefill_first: bool = False  # vLLM v0's scheduling (needs enable_chunked_prefill=False)
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "recompute"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks
    # The host-memory KV tier (vLLM's --kv-offloading-size GiB, --kv-offloading-backend): the
    # shortcut that sets kv_transfer_config to the OffloadingConnector (None: no tier).
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    num_gpu_blocks_override: int | None = None
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # layers split into this many stages (world = tp * pp)
    # Layers per stage, comma-separated, first stage first (vLLM's VLLM_PP_LAYER_PARTITION);
    # None: vLLM's even split. The last stage also computes the LM head: a lighter share
    # there balances the stages.
    pp_layer_partition: str | None = None
    distributed_executor_backend: str | None = None  # None: mp when tp * pp > 1
    # Data parallelism (vLLM's names): replicas behind one front that routes each request
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"
    restart_dead_replicas: bool = True
    router: str = "round-robin"
    enforce_eager: bool = False
    # vLLM's: serve a sliding-window model as full attention, max_model_len capped to the window
    disable_sliding_window: bool = False
    # vLLM's: a model mixing sliding-window and full layers keeps every block in every layer
    # (one KV cache group) instead of the hybrid groups (core/kv_cache_groups.py)
    disable_hybrid_kv_cache_manager: bool = False
    # Weights (core/quantization.py): None, or gguf (a .gguf model), int8/fp8 (quantized at load
    # time), gptq/awq (named by the checkpoint); KV cache: auto (the model's dtype) or fp8.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    # LoRA (vLLM's names): adapters per step, largest rank, adapters held in host memory
    # (None: max_loras). Set without enable_lora they are refused, not ignored.
    enable_lora: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    # The CPU kernels (core/kernel_settings.py): they change step times, so a run records them
    cpu_attention: str = "native"
    fused_decode: bool = True
    fused_packed: bool = True
    quant_activations: str = "int8"
    # Speculative decoding (vLLM's --speculative-config): the object, its keys as a mapping or
    # as JSON text; held as a SpeculativeConfig once built (None: off).
    speculative_config: SpeculativeConfig | dict | str | None = None
    # A KV connector (vLLM's --kv-transfer-config): disaggregated prefill/decode through the
    # Peer connector; the object, its keys as a mapping or as JSON text (None: no connector).
    kv_transfer_config: KVTransferConfig | dict | str | None = None

    def __post_init__(self) -> None:
        hints = _hints()  # (resolving the annotations once, not per field: 14 ms -> 0.5 ms)
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        _positive(self, "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                  "kv_cache_memory_bytes", "num_gpu_blocks_override", "tensor_parallel_size",
                  "pipeline_parallel_size", "data_parallel_size", "max_waiting_requests",
                  "max_waiting_tokens", "max_loras", "max_lora_rank", "max_cpu_loras")
        if not self.enable_lora:
            for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is set but enable_lora is not: set enable_lora=True "
                                     "(--enable-lora) to serve LoRA adapters.")
        if self.prefill_first and self.enable_chunked_prefill:
            raise ValueError("prefill_first is vLLM v0's scheduler without chunked prefill: "
                             "set enable_chunked_prefill=False (--no-enable-chunked-prefill).")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}.")
        check_quantization(self.quantization)
        check_kv_cache_dtype(self.kv_cache_dtype)
        self.kernel_settings()  # (validates the kernel choices, naming the argument)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("device", self.device, DEVICES)
        _one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if self.distributed_executor_backend is not None:
            _one_of("distributed_executor_backend", self.distributed_executor_backend,
                    EXECUTOR_BACKENDS)
        _one_of("data_parallel_backend", self.data_parallel_backend, EXECUTOR_BACKENDS)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}.")
        check_kv_offloading(self.kv_offloading_size, self.kv_offloading_backend)
        self.layer_partition()  # (validates it against pipeline_parallel_size, naming it)
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        self.kv_transfer_config = KVTransferConfig.of(self.kv_transfer_config)
        if self.kv_offloading_size is not None and self.kv_transfer_config is not None:
            raise ValueError("kv_offloading_size sets kv_transfer_config to the "
                             "OffloadingConnector: give one or the other (one connector per "
                             "engine; vLLM needs its MultiConnector for both).")

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """``speculative_config`` as built (``__post_init__`` builds it from what was given)."""
        spec = self.speculative_config
        return spec if isinstance(spec, SpeculativeConfig) else SpeculativeConfig.of(spec)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "engine arguments",
                     **overrides: Any) -> EngineArgs:
        """Builds from a mapping (a YAML file's keys: dashes or underscores); ``overrides`` win.
        An unknown key, a wrong type or an argument twinserve does not implement raises
        ValueError naming the key and ``source``."""
        known = set(cls.field_names())
        kwargs: dict[str, Any] = {}
        for raw_key, value in {**values, **overrides}.items():
            key = str(raw_key).replace("-", "_")
            if key in NOT_IMPLEMENTED:  # at its "not used" value it changes nothing: dropped
                check_not_implemented(key, value, source)
                continue
            if key not in known:
                raise ValueError(f"{source}: unknown engine argument {raw_key!r}; valid: "
                                 f"{', '.join(sorted(known))}.")
            kwargs[key] = value
        try:
            return cls(**kwargs)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    def layer_partition(self) -> tuple[int, ...] | None:
        """``pp_layer_partition`` as layers per stage (None: the even split); raises ValueError
        unless it holds one positive integer per pipeline stage."""
        text = self.pp_layer_partition
        if text is None:
            return None
        if self.pipeline_parallel_size == 1:
            raise ValueError("pp_layer_partition splits the layers into pipeline stages: it "
                             "needs pipeline_parallel_size > 1.")
        try:
            sizes = tuple(int(part) for part in text.split(","))
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) < 1 or len(sizes) != self.pipeline_parallel_size:
            raise ValueError(f"pp_layer_partition must be {self.pipeline_parallel_size} positive "
                             "integers separated by commas, one per pipeline stage (e.g. "
                             f"'19,11' for 2 stages), got {text!r}.")
        return sizes

    def kernel_settings(self) -> KernelSettings:
        return KernelSettings(self.cpu_attention, self.fused_decode, self.fused_packed,
                              self.quant_activations)

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA limits (vLLM's defaults: 1 adapter, rank 16), or None without enable_lora."""
        if not self.enable_lora:
            return None
        max_loras = self.max_loras or 1
        return LoRAConfig(max_loras, self.max_lora_rank or 16, self.max_cpu_loras or max_loras)


def check_not_implemented(name: str, value: Any, source: str = "engine arguments") -> None:
    """Raises ValueError when ``name`` is a vLLM argument twinserve lacks, set to a real value."""
    if name in NOT_IMPLEMENTED and value != NOT_IMPLEMENTED[name]:
        raise ValueError(f"{source}: engine argument {name!r} is not implemented by twinserve "
                         f"(got {value!r}); leave it unset.")


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(EngineArgs)


def _check_type(name: str, value: Any, hint: Any) -> None:
    allowed = _allowed_types(hint)
    if value is None and type(None) in allowed:
        return
    if isinstance(value, bool) and bool not in allowed:
        raise ValueError(f"{name} must be {_describe(allowed)}, got {value!r}.")
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return
    if not isinstance(value, tuple(t for t in allowed if t is not type(None))):
        raise ValueError(f"{name} must be {_describe(allowed)}, got {value!r}.")


def _allowed_types(hint: Any) -> tuple[type, ...]:
    args = typing.get_args(hint)
    if args and not isinstance(hint, type):  # a union (X | None) or a generic (dict[str, Any])
        origin = typing.get_origin(hint)
        if origin in (dict, list, tuple):
            return (origin,)
        return tuple(a if isinstance(a, type) else typing.get_origin(a) for a in args)
    return (hint,)


def _describe(types_: tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             dict: "a mapping", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in types_)


def _positive(args: EngineArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _one_of(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name} must be one of {', '.join(valid)}; got {value!r}.")
