"""A GPU (or CPU) as the cost model sees it: peaks, achievable efficiencies, fixed overheads, links.

Profiles are JSON files: the bundled ones live in ``simulator/data/hardware/<name>.json`` (drop a new
file there to add a name) and any other file loads by path. A profile may carry ``fitted`` entries,
step-time coefficients measured on that machine (see ``cost_model.FittedCostModel``); a calibrated
profile is just a profile file with that section filled in, saved with ``save``.

Units: FLOP/s, bytes/s, bytes, seconds. ``mem_capacity`` is the total the device reports
(``torch.cuda.mem_get_info``), which is what vLLM multiplies by ``gpu_memory_utilization``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeGuard

from twinserve.core.engine_config import Platform
from twinserve.core.kernel_settings import KernelSettings
from twinserve.simulator.kv_transfer import LinkSpec, resolve_link
from twinserve.simulator.structured_cost import DEFAULT_MASK_S_PER_ROW, DEFAULT_MASK_S_PER_STEP

_HARDWARE_DIR = Path(__file__).parent / "data" / "hardware"
_ALIASES = MappingProxyType({"h100": "h100-sxm", "h100-80gb": "h100-sxm", "a100": "a100-80gb",
                             "h200-141gb": "h200"})


STEP_SPACE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")


@dataclass(slots=True, frozen=True)
class FittedParams:
    """A linear step-time model measured for one model at one tensor-parallel size.

    ``seconds = intercept_s + sum(coefficients[f] * features[f])`` with the feature names of
    ``cost_model.FEATURE_NAMES``. ``model`` ``None`` means "any model" (a fit that was not labelled).
    """

    intercept_s: float
    coefficients: Mapping[str, float]
    model: str | None = None
    tensor_parallel_size: int = 1
    num_samples: int = 0
    rmse_s: float = 0.0
    # what the fit rests on (e.g. "vidur:a100/meta-llama/Meta-Llama-3-8B@<commit>"); "" for a fit
    # of this machine's own steps
    source: str = ""
    # the stated fit error on the data it was fitted to, in percent: "<kind>_mape" and
    # "<kind>_max" per step kind (prefill, decode, mixed, all)
    fit_error: Mapping[str, float] = field(default_factory=dict)
    # the host-speed probe's steps (``gpu.profiler.speed_probe``: label -> seconds) timed at
    # calibration, so that a later timing of the same steps tells how fast the host runs now
    speed_probe: Mapping[str, float] = field(default_factory=dict)
    # the engine's kernel choices while the fitted steps ran (``core.kernel_settings``); empty
    # for a fit that did not record them (older profiles, other engines' measurements)
    kernel_settings: Mapping[str, Any] = field(default_factory=dict)
    # the engine limits the fitted steps spanned (``STEP_SPACE_KEYS``); empty where not recorded
    step_space: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_non_negative("intercept_s", self.intercept_s)
        _check_non_negative("rmse_s", self.rmse_s)
        coefficients = dict(self.coefficients)
        for key, value in coefficients.items():
            _check_non_negative(f"coefficients[{key!r}]", value)
        object.__setattr__(self, "coefficients", MappingProxyType(coefficients))
        if not isinstance(self.source, str):
            raise ValueError(f"source must be a string, got {self.source!r}.")
        errors = dict(self.fit_error)
        for key, value in errors.items():
            _check_non_negative(f"fit_error[{key!r}]", value)
        object.__setattr__(self, "fit_error", MappingProxyType(errors))
        probe = dict(self.speed_probe)
        for key, value in probe.items():
            _check_positive(f"speed_probe[{key!r}]", value)
        object.__setattr__(self, "speed_probe", MappingProxyType(probe))
        kernels = dict(self.kernel_settings)
        if kernels:  # every field, each valid
            kernels = KernelSettings.from_mapping(kernels).to_dict()
        object.__setattr__(self, "kernel_settings", MappingProxyType(kernels))
        space = dict(self.step_space)
        if space and (set(space) != set(STEP_SPACE_KEYS) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in space.values())):
            raise ValueError(f"step_space must map {list(STEP_SPACE_KEYS)} to integers >= 1, "
                             f"got {space!r}.")
        object.__setattr__(self, "step_space", MappingProxyType(space))
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be an integer >= 1, got "
                             f"{self.tensor_parallel_size!r}.")
        if not isinstance(self.num_samples, int) or self.num_samples < 0:
            raise ValueError(f"num_samples must be a non-negative integer, got {self.num_samples!r}.")

    def beyond(self, limits: Mapping[str, int], speculative_tokens: int = 0) -> str:
        """Which of an engine's ``limits`` (``STEP_SPACE_KEYS``) reach past the steps this fit
        was measured on ("": none, or no space recorded): the twin extrapolates there. With
        ``speculative_tokens`` k, a verification step holds up to ``max_num_seqs`` x (1 + k)
        rows, which the CPU's decode kernel runs as that many sequences."""
        space = self.step_space
        if not space:
            return ""
        reach = dict(limits)
        if speculative_tokens:
            reach["max_num_seqs"] = reach["max_num_seqs"] * (1 + speculative_tokens)
        over = [f"{k} {reach[k]} (fitted up to {space[k]})" for k in STEP_SPACE_KEYS
                if reach[k] > space[k]]
        if not over:
            return ""
        rows = " with verification rows" if speculative_tokens else ""
        return ("the engine's steps reach past the profile's measured ones" + rows + ": "
                + ", ".join(over) + "; the twin extrapolates there (calibrate over these limits)")

    def matches(self, model_name: str, tensor_parallel_size: int) -> bool:
        same_model = self.model is None or self.model.lower() == model_name.lower()
        return same_model and self.tensor_parallel_size == tensor_parallel_size

    def host_speed(self, probe: Mapping[str, float]) -> float:
        """How many times the calibration's time the probe's steps take now: the median over
        the steps timed both times of ``probe[step] / speed_probe[step]``."""
        ratios = [seconds / self.speed_probe[k] for k, seconds in probe.items()
                  if k in self.speed_probe]
        if not ratios:
            raise ValueError("the fit holds no speed probe of the probed steps (calibrate again "
                             "to record one)." if self.speed_probe else
                             "the fit holds no speed probe (calibrate again to record one).")
        return statistics.median(ratios)

    def scaled(self, factor: float) -> FittedParams:
        """The fit of a host ``factor`` times slower: every term and the probe times ``factor``."""
        _check_positive("factor", factor)
        return replace(self, intercept_s=self.intercept_s * factor,
                       coefficients={k: v * factor for k, v in self.coefficients.items()},
                       speed_probe={k: v * factor for k, v in self.speed_probe.items()})

    def describe(self) -> str:
        """One line naming what the fit rests on (for run folders and reports)."""
        what = self.source or "steps measured on the machine (twinserve calibrate)"
        error = self.fit_error.get("all_mape")
        stated = f", fit error {error:.1f}% mean" if error is not None else ""
        return f"fitted to {what} ({self.num_samples} samples{stated})"

    def to_dict(self) -> dict[str, Any]:
        data = {"model": self.model, "tensor_parallel_size": self.tensor_parallel_size,
                "intercept_s": self.intercept_s, "coefficients": dict(self.coefficients),
                "num_samples": self.num_samples, "rmse_s": self.rmse_s}
        if self.source:
            data["source"] = self.source
        if self.fit_error:
            data["fit_error"] = dict(self.fit_error)
        if self.speed_probe:
            data["speed_probe"] = dict(self.speed_probe)
        if self.kernel_settings:
            data["kernel_settings"] = dict(self.kernel_settings)
        if self.step_space:
            data["step_space"] = dict(self.step_space)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FittedParams:
        return cls(**_known_keys(cls, data, "fitted"))


@dataclass(slots=True, frozen=True)
class HardwareProfile:
    """One device. ``eff_*`` scale the published peaks to what kernels achieve; the overheads are
    added to every step (``step_overhead_s``), per layer and per scheduled sequence."""

    name: str
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s
    mem_bandwidth: float  # bytes/s
    mem_capacity: int  # bytes
    eff_compute: float
    eff_memory: float
    step_overhead_s: float
    per_layer_overhead_s: float
    per_seq_overhead_s: float
    interconnect_bandwidth: float  # all-reduce bus bandwidth per GPU, bytes/s (nccl-tests busbw)
    interconnect_latency_s: float  # fixed cost of one all-reduce
    pcie_bandwidth: float  # host<->device copies (swap), bytes/s
    device_type: str = "cuda"  # "cpu": the engine runs on the host (KV budget as on a CPU)
    native_bf16: bool = True  # a CPU with avx512_bf16/AMX: dtype auto resolves to bfloat16
    # LoRA kernels (see ``lora_cost``): their share of the achievable rates, and fixed costs per
    # step with adapters and per distinct adapter. The defaults are the bare roofline;
    # calibration measures them on the real engine.
    lora_efficiency: float = 1.0
    lora_step_overhead_s: float = 0.0
    lora_per_adapter_s: float = 0.0
    # Constrained decoding's grammar masks (``structured_cost``): per constrained row and per
    # step with any; defaults measured on the development CPU, calibration measures them.
    structured_mask_s_per_row: float = DEFAULT_MASK_S_PER_ROW
    structured_mask_s_per_step: float = DEFAULT_MASK_S_PER_STEP
    notes: str = ""
    # what the roofline numbers (efficiencies, overheads) rest on; "" means assumed, not measured
    roofline_source: str = ""
    # what interconnect_latency_s and interconnect_bandwidth rest on ("" means assumed) and their
    # stated error on that data, in percent ("<size band>_mape" / "<size band>_max", "all_*")
    interconnect_source: str = ""
    interconnect_fit_error: Mapping[str, float] = field(default_factory=dict)
    fitted: tuple[FittedParams, ...] = field(default_factory=tuple)
    # The KV connector's link as measured by ``calibrate`` (``{"bandwidth_bytes_per_s": X,
    # "latency_s": Y}``, see ``kv_transfer.LinkSpec``); None: only the presets of the GPU.
    kv_link: Mapping[str, Any] | None = None
    # Pipeline stages sharing one host (``simulator.pipeline``): how many times longer a stage's
    # compute takes while one other stage of the same host computes (measured by ``calibrate``
    # at PP > 1 on a CPU, ``gpu.measurement.stage_overlap``). 1.0: the stages are separate
    # devices, as each GPU of a PP deployment is (vLLM places one rank per GPU).
    shared_stage_slowdown: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be a non-empty string.")
        for key in ("peak_flops", "mem_bandwidth", "mem_capacity", "interconnect_bandwidth",
                    "pcie_bandwidth"):
            _check_positive(key, getattr(self, key))
        for key in ("eff_compute", "eff_memory", "lora_efficiency"):
            value = getattr(self, key)
            _check_positive(key, value)
            if value > 1.0:
                raise ValueError(f"{key} must be in (0, 1], got {value!r}.")
        for key in ("step_overhead_s", "per_layer_overhead_s", "per_seq_overhead_s",
                    "interconnect_latency_s", "lora_step_overhead_s", "lora_per_adapter_s",
                    "structured_mask_s_per_row", "structured_mask_s_per_step"):
            _check_non_negative(key, getattr(self, key))
        _check_positive("shared_stage_slowdown", self.shared_stage_slowdown)
        if self.shared_stage_slowdown < 1.0:
            raise ValueError("shared_stage_slowdown must be >= 1 (1: stages on separate "
                             f"devices), got {self.shared_stage_slowdown!r}.")
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be cpu or cuda, got {self.device_type!r}.")
        errors = dict(self.interconnect_fit_error)
        for key, value in errors.items():
            _check_non_negative(f"interconnect_fit_error[{key!r}]", value)
        object.__setattr__(self, "interconnect_fit_error", MappingProxyType(errors))
        object.__setattr__(self, "fitted", tuple(self.fitted))
        if self.kv_link is not None:
            LinkSpec.from_dict(self.kv_link)  # (validates, naming the key)
            object.__setattr__(self, "kv_link", MappingProxyType(dict(self.kv_link)))

    def kv_link_spec(self, name: str | None = None) -> LinkSpec:
        """The link for KV transfers between instances of this device: a preset by name
        (nvlink, infiniband, pcie) or "measured"; None: the measured link if the profile has
        one, else NVLink (``kv_transfer.resolve_link``)."""
        return resolve_link(self.name, name, self.kv_link)

    def platform(self) -> Platform:
        """The device as the engine configuration sees it (``core.engine_config``)."""
        return Platform(self.device_type, self.name, int(self.mem_capacity), self.native_bf16)

    def describe_roofline(self, model_name: str | None = None, tensor_parallel_size: int = 1) -> str:
        """How far the roofline numbers are measured (for run folders and reports); given the
        run's model and TP size, also which fits the profile holds instead, and the links."""
        if self.roofline_source:
            text = f"roofline calibrated on {self.roofline_source}"
        else:
            text = (f"roofline (uncalibrated: assumed eff_compute={self.eff_compute:g}, "
                    f"eff_memory={self.eff_memory:g})")
        if model_name is not None and self.fitted:
            sizes: dict[str, list[str]] = {}
            for f in self.fitted:
                sizes.setdefault(f.model or "any model", []).append(str(f.tensor_parallel_size))
            held = "; ".join(f"{m} at TP {', '.join(tps)}" for m, tps in sizes.items())
            text += f"; no fit for {model_name} at TP {tensor_parallel_size} (fits: {held})"
        if tensor_parallel_size > 1:
            text += f"; all-reduce {self.interconnect_source or 'assumed (not measured)'}"
        return text

    def find_fitted(self, model_name: str, tensor_parallel_size: int = 1) -> FittedParams | None:
        """The fit for this model and TP size: an exact model match first, then an unlabelled one."""
        matches = [f for f in self.fitted if f.matches(model_name, tensor_parallel_size)]
        matches.sort(key=lambda f: f.model is None)
        return matches[0] if matches else None

    def with_fitted(self, params: FittedParams) -> HardwareProfile:
        """A copy holding ``params``, replacing any fit for the same model and TP size."""
        kept = tuple(f for f in self.fitted
                     if (f.model, f.tensor_parallel_size) != (params.model, params.tensor_parallel_size))
        return replace(self, fitted=kept + (params,))

    def at_host_speed(self, factor: float) -> HardwareProfile:
        """This profile on a host ``factor`` times slower than at calibration (every fit scaled,
        ``FittedParams.scaled``): what ``calibrate --relevel`` writes."""
        return replace(self, fitted=tuple(f.scaled(factor) for f in self.fitted))

    def stage_slowdown(self, others_busy: int) -> float:
        """How many times longer a pipeline stage's compute takes while ``others_busy`` other
        stages of this host compute: each adds the measured pair's extra time
        (``1 + k x (shared_stage_slowdown - 1)``, memory-bound steps sharing one bandwidth; only
        ``k = 1`` is measured)."""
        if others_busy < 0:
            raise ValueError(f"others_busy must be >= 0, got {others_busy}.")
        return 1.0 + others_busy * (self.shared_stage_slowdown - 1.0)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "fitted"}
        data["interconnect_fit_error"] = dict(self.interconnect_fit_error)
        data["fitted"] = [f.to_dict() for f in self.fitted]
        if self.shared_stage_slowdown == 1.0:  # (profiles written before it compare equal)
            del data["shared_stage_slowdown"]
        if self.kv_link is None:
            del data["kv_link"]
        else:
            data["kv_link"] = dict(self.kv_link)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HardwareProfile:
        values = _known_keys(cls, data, "hardware profile")
        fitted = values.pop("fitted", None) or []
        if isinstance(fitted, Mapping):  # a single entry written without the list
            fitted = [fitted]
        return cls(**values, fitted=tuple(FittedParams.from_dict(f) for f in fitted))

    def save(self, path: str | Path) -> Path:
        """Write as JSON (loadable with ``load_hardware(path)``); returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path


def load_hardware(name_or_path: str | Path) -> HardwareProfile:
    """A profile JSON by path, or a bundled name (case-insensitive, see ``bundled_hardware_names``)."""
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        path = _bundled_path(str(name_or_path))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"hardware profile {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ValueError(f"hardware profile {str(path)!r} must hold a JSON object.")
    return HardwareProfile.from_dict(data)


# (words in the name torch reports, bundled profile); the first match wins
_DEVICE_PROFILES = ((("H200",), "h200"), (("H100",), "h100-sxm"), (("A100", "80GB"), "a100-80gb"),
                    (("A100",), "a100-40gb"))


def bundled_profile_for_device(device_name: str) -> str | None:
    """The bundled profile of a GPU by the name torch reports (``NVIDIA H200``,
    ``NVIDIA A100-SXM4-80GB``), or None when none matches."""
    upper = device_name.upper()
    for words, profile in _DEVICE_PROFILES:
        if all(w in upper for w in words):
            return profile
    return None


def bundled_hardware_names() -> list[str]:
    return sorted(p.stem for p in _HARDWARE_DIR.glob("*.json"))


def _bundled_path(name: str) -> Path:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    path = _HARDWARE_DIR / f"{key}.json"
    if not path.is_file():
        raise ValueError(f"unknown hardware {name!r}: not a profile file and not a bundled profile. "
                         f"Valid names: {', '.join(bundled_hardware_names())}.")
    return path


def _known_keys(cls: type, data: Mapping[str, Any], what: str) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{what} has unknown field(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(names))}.")
    return dict(data)


def _check_positive(name: str, value: object) -> None:
    if not _is_finite_number(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}.")


def _check_non_negative(name: str, value: object) -> None:
    if not _is_finite_number(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}.")


def _is_finite_number(value: object) -> TypeGuard[float]:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))
