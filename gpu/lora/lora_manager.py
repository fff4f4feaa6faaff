"""The real engine's LoRA adapters: host memory (an LRU of ``max_cpu_loras``) and the
``max_loras`` device slots the shared scheduler assigns (``core.lora.LoRASlots``).

    acquire(LoRARequest)      when a request is added: read and check the adapter (once; later
                              requests find it in host memory) and pin it there
    release(name)             when the request has left the engine
    load_slots(loads)         at the start of a step: copy its ``lora_loads`` into their slots
    begin_step(scheduled)     before the forward: group the step's rows by slot
    end_step()

An adapter pinned by a request is never dropped from host memory, so a slot load cannot fail in
the middle of a step; an unpinned one is dropped least recently used first when a new adapter
needs the room. When every host entry is pinned a new adapter is refused as an overload
(``EngineOverloaded``): client-chosen adapters cannot grow host memory without bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from twinserve.core.errors import EngineOverloaded
from twinserve.core.lora import LoRAConfig, LoRARequest
from twinserve.core.model_config import ModelConfig
from twinserve.core.outputs import ScheduledRequest
from twinserve.gpu.layers.linear import LinearBase
from twinserve.gpu.lora.lora_layers import LinearLoRA, LoRABatch, LoRAContext, LoRALinearMethod
from twinserve.gpu.lora.lora_weights import LoRAAdapter, load_peft_adapter
from twinserve.gpu.models.model import CausalLM

LORA_RETRY_AFTER_S = 1.0
# Host bytes the CPU's slot-stacked adapter copies (for batched products) may take in all.
STACKED_BUDGET_BYTES = 512 << 20


class LoRAManager:
    """Wraps every decoder projection of ``model`` with a LoRA method and manages adapters."""

    def __init__(self, model: CausalLM, config: ModelConfig, lora: LoRAConfig,
                 use_triton: bool = False) -> None:
        self.config, self.lora_config = config, lora
        self.context = LoRAContext()
        self.layers: list[list[LinearLoRA]] = []
        device = model.embed_tokens.device
        stacked = self._stacked_bytes(config, lora) <= STACKED_BUDGET_BYTES
        for layer in model.layers:
            wrapped = []
            for spec in config.arch.linears(config):
                linear: LinearBase = getattr(layer, spec.name)
                offsets, start = [], 0
                for shard in spec.shards:
                    offsets.append((shard.hf_name.rpartition(".")[2], start, shard.output_size))
                    start += shard.output_size
                weights = LinearLoRA(offsets, spec.input_size, lora.max_loras, lora.max_lora_rank,
                                     model.embed_tokens.dtype, device, use_triton, stacked)
                linear.quant_method = LoRALinearMethod(linear.quant_method, weights, self.context)
                wrapped.append(weights)
            self.layers.append(wrapped)
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU first
        self._pins: dict[str, int] = {}
        self.slot_names: list[str | None] = [None] * lora.max_loras
        self._device = device
        self.num_disk_loads = 0

    @staticmethod
    def _stacked_bytes(config: ModelConfig, lora: LoRAConfig) -> int:
        """float32 bytes of every layer's slot-stacked A and B at ``max_lora_rank``."""
        per_layer = sum(len(spec.shards) * lora.max_lora_rank * (spec.input_size + spec.output_size)
                        for spec in config.arch.linears(config))
        return 4 * lora.max_loras * per_layer * config.num_hidden_layers

    # ---- adapters in host memory -----------------------------------------------------------
    def acquire(self, request: LoRARequest) -> str:
        """Makes ``request``'s adapter available and pins it; returns its name. Raises
        ValueError for an adapter that cannot be served, EngineOverloaded when host memory holds
        only pinned adapters."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}.")
        name = request.lora_name
        known = self._host.get(name)
        if known is not None:
            if (known.int_id, known.path) != (request.lora_int_id, request.lora_path):
                raise ValueError(
                    f"LoRA adapter {name!r} is loaded as id {known.int_id} from {known.path}; "
                    f"got id {request.lora_int_id} from {request.lora_path}: one name, one adapter.")
            self._host.move_to_end(name)
        else:
            self._make_room(name)
            self._host[name] = load_peft_adapter(request, self.config,
                                                 self.lora_config.max_lora_rank)
            self.num_disk_loads += 1
        self._pins[name] = self._pins.get(name, 0) + 1
        return name

    def release(self, name: str) -> None:
        count = self._pins.get(name, 0) - 1
        if count > 0:
            self._pins[name] = count
        else:
            self._pins.pop(name, None)

    def _make_room(self, name: str) -> None:
        capacity = self.lora_config.max_cpu_loras
        while len(self._host) >= capacity:
            idle = next((n for n in self._host if n not in self._pins), None)
            if idle is None:
                raise EngineOverloaded(
                    f"LoRA adapter {name!r} cannot be loaded now: all max_cpu_loras "
                    f"({capacity}) adapters in host memory have requests in flight; retry later.",
                    "max_cpu_loras", LORA_RETRY_AFTER_S)
            del self._host[idle]

    def loaded(self) -> list[LoRAAdapter]:
        """The adapters in host memory, least recently used first."""
        return list(self._host.values())

    def is_pinned(self, name: str) -> bool:
        return name in self._pins

    def drop(self, name: str) -> None:
        """Forgets an unpinned adapter (the server's unload); raises ValueError if pinned."""
        if name in self._pins:
            raise ValueError(f"LoRA adapter {name!r} has requests in flight.")
        self._host.pop(name, None)

    # ---- one step ----------------------------------------------------------------------------
    def load_slots(self, loads: Sequence[tuple[str, int]]) -> None:
        for name, slot in loads:
            self._load_slot(name, slot)

    def group_by_adapter(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """The step's requests reordered so that each adapter's rows are contiguous (base-model
        requests first; otherwise in scheduler order): every segment is then a slice, with no
        gather and scatter per projection. Results are keyed by request id, so the order of
        the flattened batch is the runner's to choose."""
        slot_of = {name: slot for slot, name in enumerate(self.slot_names) if name is not None}
        return sorted(scheduled, key=lambda sr: -1 if sr.request.lora is None
                      else slot_of[sr.request.lora])

    def begin_step(self, scheduled: list[ScheduledRequest]) -> None:
        ranges, row = [], 0
        slot_of = {name: slot for slot, name in enumerate(self.slot_names) if name is not None}
        for sr in scheduled:
            lora = sr.request.lora
            if lora is not None:
                ranges.append((slot_of[lora], row, row + sr.num_new_tokens))
            row += sr.num_new_tokens
        self.context.batch = LoRABatch.build(ranges, self._device) if ranges else None

    def end_step(self) -> None:
        self.context.batch = None

    def _load_slot(self, name: str, slot: int) -> None:
        adapter = self._host.get(name)
        if adapter is None:  # only possible for a request the engine was never told of
            raise RuntimeError(f"LoRA adapter {name!r} is scheduled but not in host memory.")
        self._host.move_to_end(name)
        per_layer: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in range(len(self.layers))]
        for (layer, module), pair in adapter.weights.items():
            per_layer[layer][module] = pair
        for layer_weights, pairs in zip(self.layers, per_layer):
            for weights in layer_weights:
                weights.set_slot(slot, pairs, adapter.rank)
        self.slot_names[slot] = name
