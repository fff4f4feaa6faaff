"""What a simulation adds for LoRA: the cost model's LoRA terms for the workload's adapters, a
per-replica tally of the adapter loads, and the run's LoRA figures for its summary.

Summary keys (only for a run with LoRA enabled): ``lora_loads`` (adapters copied into a device
slot, all replicas), ``lora_load_time_s`` (the seconds those copies were charged),
``num_lora_adapters`` (distinct adapters the requests named), ``lora_request_share`` (share of the
requests with an adapter) and ``lora_mean_ttft_ms`` ({adapter: mean TTFT in ms}, finished
requests; the base model's requests under ``base``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.core.metrics import RequestRecord
from twinserve.core.model_config import ModelConfig
from twinserve.core.outputs import SchedulerOutput
from twinserve.simulator.hardware import HardwareProfile
from twinserve.simulator.lora_cost import LoRACost
from twinserve.simulator.step_time import StepTimeModel
from twinserve.traces.lora import BASE_MODEL, AdapterShape, LoRAAdapters, adapter_names
from twinserve.traces.trace_request import TraceRequest


def lora_cost_for(args: EngineArgs, model: ModelConfig, hardware: HardwareProfile,
                  trace: Sequence[TraceRequest], adapters: LoRAAdapters | None) -> LoRACost | None:
    """The LoRA terms of a run (``None`` with LoRA disabled). Raises ValueError for adapters the
    engine would refuse: any adapter without ``enable_lora``, a rank above ``max_lora_rank``.
    ``adapters`` ``None``: every adapter at ``max_lora_rank``, all seven projections."""
    names = adapter_names(trace)
    lora = args.lora_config()
    if lora is None:
        if names:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise ValueError(f"the workload's requests use {len(names)} LoRA adapter(s) ({shown}) "
                             "but LoRA is not enabled: add --enable-lora (and --max-loras N).")
        return None
    if adapters is None:
        adapters = LoRAAdapters(AdapterShape(lora.max_lora_rank))
    cost = LoRACost(model, hardware, adapters, lora.max_lora_rank, args.tensor_parallel_size)
    for name in names:
        cost.terms(name)  # refuses a rank above max_lora_rank now, not mid-run
    return cost


class LoadTally:
    """A replica's step-time model (``inner``) that also counts the adapter loads and the
    seconds charged for them (``load_time``: the cost model's ``lora_load_time``). Every step
    goes through the tally, so it offers no decode-run shortcut."""

    __slots__ = ("inner", "load_time", "loads", "load_s")

    def __init__(self, inner: StepTimeModel,
                 load_time: Callable[[Sequence[tuple[str, int]]], float]) -> None:
        self.inner = inner
        self.load_time = load_time
        self.loads = 0
        self.load_s = 0.0

    def step_time(self, out: SchedulerOutput) -> float:
        loads = out.lora_loads
        if loads:
            self.loads += len(loads)
            self.load_s += self.load_time(loads)
        return self.inner.step_time(out)

    def decode_run_ends(self, out: SchedulerOutput, now: float, horizon: float, base: float,
                        max_steps: int) -> list[float] | None:
        return None


def lora_summary(records: Sequence[RequestRecord], trace: Sequence[TraceRequest],
                 tallies: Sequence[LoadTally]) -> dict[str, Any]:
    """The run's LoRA figures (the module docstring's keys)."""
    adapter_of = {tr.request_id: tr.lora for tr in trace}
    ttfts: dict[str, list[float]] = {}
    for r in records:
        if r.success and not math.isnan(r.first_token_time):
            label = adapter_of.get(r.request_id) or BASE_MODEL
            ttfts.setdefault(label, []).append(r.ttft * 1e3)
    with_adapter = sum(1 for tr in trace if tr.lora is not None)
    return {
        "lora_loads": sum(t.loads for t in tallies),
        "lora_load_time_s": sum(t.load_s for t in tallies),
        "num_lora_adapters": len(adapter_names(trace)),
        "lora_request_share": with_adapter / len(trace) if trace else 0.0,
        "lora_mean_ttft_ms": {k: sum(v) / len(v) for k, v in sorted(ttfts.items())},
    }
