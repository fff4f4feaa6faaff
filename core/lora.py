"""LoRA adapters as the scheduler sees them: vLLM's ``LoRARequest``, the engine's LoRA limits, and
the ``max_loras`` device slots (``LoRASlots``), shared by the real engine and the twin.

A request names its adapter by ``Request.lora`` (the adapter's name, also part of its prefix-cache
block hashes). The scheduler admits a waiting request only while the distinct adapters of the
running requests stay within ``max_loras``, so no step ever mixes more. Each adapter in use holds
one of ``max_loras`` device slots; an adapter no running request uses stays in its slot until the
slot is needed (least recently used first), so a returning adapter is loaded again only when it
was evicted. ``SchedulerOutput.lora_loads`` lists the loads of a step: the real engine copies the
adapter's weights into that slot, the twin charges the host-to-device transfer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinserve.core.model_config import ModelConfig

PEFT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Step features of the LoRA terms, for calibration (``lora_step_features``): the roofline's FLOPs
# and weight bytes, the distinct adapters, whether any ran, and the bytes loaded. The real
# engine's profiler records them per measured step; the twin's cost model computes them.
LORA_FEATURE_NAMES: tuple[str, ...] = (
    "lora_flops", "lora_weight_bytes", "num_lora_adapters", "lora_steps", "lora_load_bytes")
_ROW_PARALLEL = "row"


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter for a request, as vLLM's: a unique name, a positive integer id and the PEFT
    directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty path, got {self.lora_path!r}.")


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """``max_loras`` adapters per step (device slots), ranks up to ``max_lora_rank``, and
    ``max_cpu_loras`` adapters held in host memory (at least ``max_loras``)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras}).")


class LoRASlots:
    """The ``max_loras`` device slots and the running requests' use of them.

    ``acquire`` when a request with an adapter joins the running batch, ``release`` when it
    leaves it (preempted or finished). An adapter with running requests is pinned to its slot; the
    others stay resident until evicted, least recently released first. All operations are O(1).
    """

    __slots__ = ("max_loras", "users", "slot_of", "_idle", "_free", "loads", "num_loads",
                 "waiting", "num_base_waiting")

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be positive, got {max_loras}.")
        self.max_loras = max_loras
        self.users: dict[str, int] = {}  # adapter -> running requests using it (pinned)
        self.slot_of: dict[str, int] = {}  # resident adapters
        self._idle: OrderedDict[str, None] = OrderedDict()  # resident, unpinned, LRU first
        self._free = list(range(max_loras - 1, -1, -1))
        self.loads: list[tuple[str, int]] = []  # (adapter, slot) loaded since the last take
        self.num_loads = 0
        # Waiting requests per adapter (and of the base model): whether any waiting request
        # could be admitted now is O(max_loras), so a step need not look past every blocked one.
        self.waiting: dict[str, int] = {}
        self.num_base_waiting = 0

    @property
    def num_active(self) -> int:
        """Distinct adapters of the running requests."""
        return len(self.users)

    def is_resident(self, lora: str) -> bool:
        return lora in self.slot_of

    def can_acquire(self, lora: str) -> bool:
        """Whether one more running request may use ``lora`` without passing ``max_loras``."""
        return lora in self.users or len(self.users) < self.max_loras

    def acquire(self, lora: str) -> int:
        """Pins ``lora`` for one more running request; loads it into a slot if not resident."""
        count = self.users.get(lora)
        if count is not None:
            self.users[lora] = count + 1
            return self.slot_of[lora]
        if len(self.users) >= self.max_loras:
            raise RuntimeError(f"adapter {lora!r} exceeds max_loras ({self.max_loras})")
        self.users[lora] = 1
        slot = self.slot_of.get(lora)
        if slot is not None:
            del self._idle[lora]
            return slot
        if self._free:
            slot = self._free.pop()
        else:  # every slot is resident and at most max_loras - 1 are pinned: evict the LRU idle one
            evicted, _ = self._idle.popitem(last=False)
            slot = self.slot_of.pop(evicted)
        self.slot_of[lora] = slot
        self.loads.append((lora, slot))
        self.num_loads += 1
        return slot

    def release(self, lora: str) -> None:
        """One running request of ``lora`` left the batch."""
        count = self.users[lora] - 1
        if count:
            self.users[lora] = count
            return
        del self.users[lora]
        self._idle[lora] = None

    def add_waiting(self, lora: str | None) -> None:
        if lora is None:
            self.num_base_waiting += 1
        else:
            self.waiting[lora] = self.waiting.get(lora, 0) + 1

    def remove_waiting(self, lora: str | None) -> None:
        if lora is None:
            self.num_base_waiting -= 1
            return
        count = self.waiting[lora] - 1
        if count:
            self.waiting[lora] = count
        else:
            del self.waiting[lora]

    def any_admissible(self) -> bool:
        """Whether a waiting request's adapter (or none) fits now: a free slot for a new adapter,
        a waiting base-model request, or one of a running adapter."""
        if self.num_base_waiting or len(self.users) < self.max_loras:
            return True
        waiting = self.waiting
        return any(lora in waiting for lora in self.users)

    def take_loads(self) -> list[tuple[str, int]]:
        loads, self.loads = self.loads, []
        return loads


# ---- the sizes of an adapter's work (shared by the twin's cost model and the profiler) ---------
def lora_elements_per_rank(model: ModelConfig, target_modules: Sequence[str],
                           tensor_parallel_size: int = 1) -> int:
    """Elements of A and B per unit of rank, all layers, on one GPU, for the adapted projections
    (tensor parallel as vLLM's layers: column-parallel ones split B, row-parallel ones A)."""
    per_layer = 0
    for spec in model.arch.linears(model):
        for shard in spec.shards:
            if shard.hf_name.rsplit(".", 1)[-1] not in target_modules:
                continue
            a, b = spec.input_size, shard.output_size
            if spec.kind == _ROW_PARALLEL:
                a = a // tensor_parallel_size
            else:
                b = b // tensor_parallel_size
            per_layer += a + b
    return per_layer * model.num_hidden_layers


def adapter_terms(model: ModelConfig, rank: int, step_rank: int, target_modules: Sequence[str],
                  tensor_parallel_size: int = 1) -> tuple[float, float, float]:
    """An adapter's FLOPs per token and weight bytes per step (at ``step_rank``: the rank its
    kernels run at), and the bytes of loading it (its own ``rank``)."""
    per_rank = lora_elements_per_rank(model, target_modules, tensor_parallel_size)
    return (2.0 * step_rank * per_rank, float(step_rank * per_rank * model.dtype_bytes),
            float(rank * per_rank * model.dtype_bytes))


@dataclass(frozen=True, slots=True)
class LoRAWork:
    """One step's LoRA terms (per GPU)."""

    flops: float = 0.0
    weight_bytes: float = 0.0
    num_adapters: int = 0
    load_bytes: float = 0.0


def lora_step_features(work: LoRAWork) -> dict[str, float]:
    """A step's LoRA features, keyed by ``LORA_FEATURE_NAMES`` (empty for a step without LoRA:
    calibration samples of base-only steps carry none)."""
    if not (work.num_adapters or work.load_bytes):
        return {}
    return dict(zip(LORA_FEATURE_NAMES, (work.flops, work.weight_bytes, float(work.num_adapters),
                                         1.0 if work.num_adapters else 0.0, work.load_bytes)))
