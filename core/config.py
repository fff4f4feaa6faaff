"""Engine knobs shared by the real engine and the simulator, under vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, fields

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(slots=True)
class SchedulerConfig:
    """Scheduler and KV-cache settings. ``num_gpu_blocks`` comes from the backend (the real engine
    derives it from memory; the simulator from the hardware profile)."""

    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # vLLM v0's scheduler without chunked prefill: a step that admits waiting prompts runs only
    # them; decodes run in the steps that admit none (Scheduler.schedule).
    prefill_first: bool = False
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "recompute"
    num_cpu_blocks: int = 0
    # Admission bounds on requests not yet admitted (None: unbounded); beyond them add_request
    # raises core.errors.EngineOverloaded.
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    # Distinct LoRA adapters per step (device slots); 0: LoRA disabled.
    max_loras: int = 0
    # The model's attention window when every layer has one (None: some layer attends to the
    # whole context); blocks wholly outside it are freed (KVCacheManager).
    sliding_window: int | None = None
    # A hybrid layout's KV cache groups, each one's window (None: full attention), when the
    # model mixes layers (Gemma 2/3); empty for one group (core/kv_cache_groups.py).
    kv_cache_group_windows: tuple[int | None, ...] = ()
    # Record the prefix cache's block-hash events for a router (core.kv_events; drained by
    # Scheduler.take_kv_events). Off: nothing is recorded.
    kv_events: bool = False

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        for name in ("long_prefill_token_threshold", "num_cpu_blocks", "max_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")
        for name in ("max_waiting_requests", "max_waiting_tokens", "sliding_window"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}.")
        for value in self.kv_cache_group_windows:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ValueError(f"kv_cache_group_windows must hold positive integers or None, "
                                 f"got {value!r}.")
        if self.kv_cache_group_windows and self.sliding_window is not None:
            raise ValueError("sliding_window and kv_cache_group_windows exclude each other.")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}.")
        if self.prefill_first and self.enable_chunked_prefill:
            raise ValueError("prefill_first is vLLM v0's scheduler without chunked prefill: "
                             "set enable_chunked_prefill=False (--no-enable-chunked-prefill).")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}): without chunked prefill a full prompt "
                "must fit in one step. Raise max_num_batched_tokens or enable chunked prefill.")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
