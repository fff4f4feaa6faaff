"""The CPU kernel choices of the real engine: engine arguments like any other, since each changes
step times (and so what a calibrated profile stands for).

- ``cpu_attention``: ``native`` decodes from the paged cache with the compiled kernel
  (``gpu/kernels/cpu_decode_kernel.py``; the plain-torch path when it cannot be built), ``torch``
  always runs the plain-torch path.
- ``fused_decode``: a quantized dense Llama-family model's decode step as one C++ call
  (``gpu/kernels/fused_decode.py``) where it applies; off: the per-op path.
- ``fused_packed``: the fused step streams Q4_0/Q4_1 weights repacked into 8-row groups; off: the
  file's rows.
- ``quant_activations``: ``int8`` quantizes activations for the integer products of Q8_0, Q4_0
  and Q4_1 (as llama.cpp does); ``fp32`` keeps them in fp32 (the exact reference).

The settings are recorded flat in every run folder's ``config.json`` (they are ``EngineArgs``
fields) and under ``kernel_settings`` in each fit a calibration writes, so that
``kernel_settings_mismatch`` can tell when a profile was measured under other kernels than the
engine it is compared with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

CPU_ATTENTION_CHOICES = ("native", "torch")
QUANT_ACTIVATION_CHOICES = ("int8", "fp32")
# chunks that the native CPU attention serves as decode rows (``rows_as_decodes``)
MAX_ROWS_AS_DECODES = 17
MAX_ROWS_AS_DECODES_AREA = 4096


def rows_as_decodes(q_len: int, seq_len: int, window: int | None = None) -> bool:
    """Whether ``cpu_attention`` ``native`` serves a sequence's chunk of ``q_len`` queries
    ending at ``seq_len`` positions as ``q_len`` rows of the decode kernel (row i seeing
    ``seq_len - q_len + 1 + i`` positions: the causal mask by construction) rather than as one
    masked chunk. Each row re-reads the context's KV but skips the chunk's gathered copy, mask
    and SDPA call, whose fixed cost dominates short chunks: a verification's 1 + k queries over
    a short context (docs/cpu-backend.md, "Attention"). The twin prices such a verification as
    the rows it runs (``simulator/spec_cost.py``)."""
    visible = seq_len if window is None else min(seq_len, window)
    return q_len <= MAX_ROWS_AS_DECODES and q_len * visible <= MAX_ROWS_AS_DECODES_AREA


@dataclass(frozen=True, slots=True)
class KernelSettings:
    """Which kernels the engine runs (defaults: the fastest measured on the CPU backend)."""

    cpu_attention: str = "native"
    fused_decode: bool = True
    fused_packed: bool = True
    quant_activations: str = "int8"

    def __post_init__(self) -> None:
        _one_of("cpu_attention", self.cpu_attention, CPU_ATTENTION_CHOICES)
        _one_of("quant_activations", self.quant_activations, QUANT_ACTIVATION_CHOICES)
        for name in ("fused_decode", "fused_packed"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}.")

    @property
    def int8_activations(self) -> bool:
        return self.quant_activations == "int8"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> KernelSettings:
        """From a mapping holding every field (a fit's ``kernel_settings``, a run's config.json;
        other keys are ignored); raises ValueError naming a missing field."""
        missing = [name for name in cls.field_names() if name not in values]
        if missing:
            raise ValueError(f"kernel settings lack {', '.join(missing)}.")
        return cls(**{name: values[name] for name in cls.field_names()})


def kernel_settings_mismatch(profile_meta: Mapping[str, Any], engine: KernelSettings) -> str | None:
    """How a profile's kernel settings differ from ``engine``'s, or None when they are the same.

    ``profile_meta`` is a fit's metadata (``FittedParams.to_dict()``), holding the settings it was
    calibrated under as ``kernel_settings``. A fit without them (calibrated before they were
    recorded, or fitted to another engine's measurements) is reported too: nothing says its
    steps ran the engine's kernels."""
    recorded = profile_meta.get("kernel_settings")
    if not recorded:
        return ("the profile records no kernel settings; the engine runs "
                + _describe(engine.to_dict()))
    if not isinstance(recorded, Mapping):
        raise ValueError(f"kernel_settings must be a mapping, got {recorded!r}.")
    profile = KernelSettings.from_mapping(recorded)
    differ = [name for name in KernelSettings.field_names()
              if getattr(profile, name) != getattr(engine, name)]
    if not differ:
        return None
    return "; ".join(f"{name}: profile {getattr(profile, name)!r}, engine "
                     f"{getattr(engine, name)!r}" for name in differ)


def _describe(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def _one_of(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name} must be one of {', '.join(valid)}; got {value!r}.")


DEFAULT_KERNELS = KernelSettings()  # (frozen: safe as a shared default argument)
