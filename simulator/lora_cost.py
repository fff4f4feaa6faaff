"""The LoRA terms of the twin's step time: the adapters' products in the forward pass, and the
host-to-device copy of each adapter made resident.

Per adapted projection ``m`` (``in_m -> out_m``) and layer, an adapter of rank ``r`` adds a shrink
(``x @ A``, ``in_m x r``) and an expand (``(x A) @ B``, ``r x out_m``)::

    flops(adapter) = 2 * tokens_of_adapter * r * sum_m (in_m + out_m) * layers
    bytes(adapter) = r * sum_m (in_m + out_m) * layers * dtype          (its A and B, read once)

summed over the distinct adapters of the step's scheduled requests. On a tensor-parallel GPU a
column-parallel projection (q/k/v, gate/up) keeps A whole and splits B's outputs; a row-parallel
one (o, down) splits A's inputs and keeps B whole (vLLM's layout without fully sharded LoRA).

Decisions, each written where the number is used:

- The step charges every adapter at ``max_lora_rank`` (``pad_to_max_rank``): vLLM copies an
  adapter into slot buffers of ``max_lora_rank`` rows, zero-padded, and its punica kernels run over
  the whole buffer. The copy itself moves only the adapter's own rank.
- The LoRA kernels run apart from the base GEMMs (shrink and expand after each projection), so
  they form a roofline group of their own, ``max(flops / rate, bytes / bandwidth)``, added to the
  step like the linear and attention groups. Activations they read and write are not counted: at
  serving batch sizes they stay in L2 next to the base GEMM's.
- The rates are the profile's achievable ones scaled by ``lora_efficiency``; a step with any
  adapter also pays ``lora_step_overhead_s`` and ``lora_per_adapter_s`` per distinct adapter.
  Their defaults (1.0, 0, 0) are the bare roofline; calibration fits them (``LORA_FEATURE_NAMES``).
- A load copies the adapter's bytes over ``pcie_bandwidth`` before the forward pass (vLLM
  activates adapters synchronously); two loads into one slot in one step cost the last one only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from twinserve.core.lora import (
    LORA_FEATURE_NAMES,
    LoRAWork,
    adapter_terms,
    lora_elements_per_rank,
    lora_step_features,
)
from twinserve.core.model_config import ModelConfig
from twinserve.core.outputs import SchedulerOutput
from twinserve.simulator.hardware import HardwareProfile
from twinserve.traces.lora import LoRAAdapters


@dataclass(slots=True)
class LoRACost:
    """The LoRA terms for ``model`` serving ``adapters`` with ``max_lora_rank`` slots."""

    model: ModelConfig
    hardware: HardwareProfile
    adapters: LoRAAdapters = field(default_factory=LoRAAdapters)
    max_lora_rank: int = 16
    tensor_parallel_size: int = 1
    pad_to_max_rank: bool = True
    _terms: dict[str, tuple[float, float, float]] = field(init=False, repr=False)
    _s_per_flop: float = field(init=False, repr=False)
    _s_per_byte: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rank = self.max_lora_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"max_lora_rank must be a positive integer, got {rank!r}.")
        hw = self.hardware
        self._s_per_flop = 1.0 / (hw.eff_compute * hw.lora_efficiency * hw.peak_flops)
        self._s_per_byte = 1.0 / (hw.eff_memory * hw.lora_efficiency * hw.mem_bandwidth)
        self._terms = {}  # adapter -> (FLOPs per token, weight bytes in a step, bytes to load)

    def terms(self, name: str) -> tuple[float, float, float]:
        """Adapter ``name``'s FLOPs per token, weight bytes per step and load bytes (cached)."""
        terms = self._terms.get(name)
        if terms is None:
            shape = self.adapters.shape(name)
            if shape.rank > self.max_lora_rank:
                raise ValueError(f"adapter {name!r} has rank {shape.rank}, above max_lora_rank "
                                 f"{self.max_lora_rank}: raise --max-lora-rank.")
            step_rank = self.max_lora_rank if self.pad_to_max_rank else shape.rank
            terms = adapter_terms(self.model, shape.rank, step_rank, shape.target_modules,
                                  self.tensor_parallel_size)
            self._terms[name] = terms
        return terms

    def adapter_bytes(self, name: str) -> float:
        """Bytes one GPU copies to make adapter ``name`` resident."""
        return self.terms(name)[2]

    def work(self, out: SchedulerOutput) -> LoRAWork:
        """The step's LoRA FLOPs, weight bytes, distinct adapters and bytes loaded."""
        tokens: dict[str, int] = {}
        for sr in out.scheduled:
            lora = sr.request.lora
            if lora is not None:
                tokens[lora] = tokens.get(lora, 0) + sr.num_new_tokens
        load = self.load_bytes(out.lora_loads) if out.lora_loads else 0.0
        if not tokens:
            return LoRAWork(load_bytes=load)
        flops = nbytes = 0.0
        for name, n in tokens.items():
            per_token, weights, _ = self.terms(name)
            flops += per_token * n
            nbytes += weights
        return LoRAWork(flops, nbytes, len(tokens), load)

    def load_bytes(self, loads: Sequence[tuple[str, int]]) -> float:
        """Bytes of a step's loads, the last load into each slot only."""
        last = {slot: name for name, slot in loads}
        return sum(self.adapter_bytes(name) for name in last.values())

    def forward_time(self, work: LoRAWork) -> float:
        """The LoRA group of the forward pass: roofline plus the per-step and per-adapter costs."""
        if not work.num_adapters:
            return 0.0
        hw = self.hardware
        compute, memory = work.flops * self._s_per_flop, work.weight_bytes * self._s_per_byte
        return (max(compute, memory) + hw.lora_step_overhead_s
                + hw.lora_per_adapter_s * work.num_adapters)

    def load_time(self, work: LoRAWork) -> float:
        """Seconds to copy the step's loads host-to-device."""
        return work.load_bytes / self.hardware.pcie_bandwidth if work.load_bytes else 0.0


__all__ = ["LORA_FEATURE_NAMES", "LoRACost", "LoRAWork", "lora_elements_per_rank",
           "lora_step_features"]
