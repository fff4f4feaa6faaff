"""Speculative decoding's configuration, under vLLM's ``--speculative-config`` keys.

Decisions: unknown keys are refused by name (a misspelt key must not silently mean "off");
the methods twinserve cannot run (EAGLE, MTP, Medusa, MLP speculators) are refused by name
rather than mapped to something else; ``model`` without ``method`` means a draft model, as in
vLLM; ``synthetic`` acceptance is for calibration only (its output tokens are not the model's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from twinserve.core.json_config import JsonConfig

METHODS = ("ngram", "suffix", "draft_model")
REFUSED_METHODS = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator")
REJECTION_SAMPLE_METHODS = ("strict", "probabilistic", "synthetic")
SPECULATION_POLICIES = ("adaptive", "fixed")  # the built-in plugins (policies/speculation/)


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}.")


def _rate(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"speculative_config.{name} must be a number in [0, 1], got {value!r}.")
    return float(value)


@dataclass(slots=True, frozen=True)
class SpeculativeConfig(JsonConfig):
    """What ``--speculative-config`` asks for. ``num_speculative_tokens`` is k_max, the most
    drafts per request and step; the speculation policy chooses 0..k_max each step."""

    CONFIG_NAME: ClassVar[str] = "speculative_config"

    method: str = "ngram"
    num_speculative_tokens: int = 1
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None
    rejection_sample_method: str = "probabilistic"
    synthetic_acceptance_rate: float | tuple[float, ...] | None = None
    policy: str = "adaptive"
    # twinserve's: the most drafts a policy may give one request in a step; the adaptive
    # policy raises a request's k from num_speculative_tokens up to it (None: no raising)
    max_num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.method in REFUSED_METHODS:
            raise ValueError(f"speculative_config.method {self.method!r} is not implemented in "
                             f"twinserve (implemented: {', '.join(METHODS)}).")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, "
                             f"got {self.method!r}.")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            _positive_int(name, getattr(self, name))
        _positive_int("disable_by_batch_size", self.disable_by_batch_size, allow_none=True)
        _positive_int("max_num_speculative_tokens", self.max_num_speculative_tokens,
                      allow_none=True)
        if self.max_drafts < self.num_speculative_tokens:
            raise ValueError("speculative_config.max_num_speculative_tokens must not be below "
                             f"num_speculative_tokens ({self.max_num_speculative_tokens} < "
                             f"{self.num_speculative_tokens}).")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_min} > "
                             f"{self.prompt_lookup_max}).")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError("speculative_config.draft_tensor_parallel_size: only 1 is "
                             f"implemented in twinserve, got {self.draft_tensor_parallel_size!r}.")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model is required for method 'draft_model'.")
        factor = self.suffix_decoding_max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor must be a "
                             f"positive number, got {factor!r}.")
        _rate("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob)
        if self.rejection_sample_method not in REJECTION_SAMPLE_METHODS:
            raise ValueError("speculative_config.rejection_sample_method must be one of "
                             f"{REJECTION_SAMPLE_METHODS}, got {self.rejection_sample_method!r}.")
        self._check_synthetic()
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError(f"speculative_config.policy must be a plugin name, got {self.policy!r}.")

    def _check_synthetic(self) -> None:
        rate = self.synthetic_acceptance_rate
        synthetic = self.rejection_sample_method == "synthetic"
        if synthetic != (rate is not None):
            raise ValueError("speculative_config.synthetic_acceptance_rate is required with "
                             "rejection_sample_method 'synthetic' and only with it.")
        if rate is None:
            return
        value: float | tuple[float, ...]
        if isinstance(rate, (list, tuple)):
            if not rate:
                raise ValueError("speculative_config.synthetic_acceptance_rate must not be empty.")
            value = tuple(_rate("synthetic_acceptance_rate", r) for r in rate)
        else:
            value = _rate("synthetic_acceptance_rate", rate)
        object.__setattr__(self, "synthetic_acceptance_rate", value)

    @property
    def max_drafts(self) -> int:
        """The most drafts a request verifies in one step: the scheduler's k_max."""
        cap = self.max_num_speculative_tokens
        return self.num_speculative_tokens if cap is None else cap

    @property
    def acceptance_rates(self) -> tuple[float, ...]:
        """The synthetic acceptance rate per draft position (``max_drafts`` of them; a single
        rate, or a list's last rate, repeats); empty unless synthetic."""
        rate = self.synthetic_acceptance_rate
        if rate is None:
            return ()
        rates = rate if isinstance(rate, tuple) else (rate,)
        k = self.max_drafts
        return tuple(rates[min(i, len(rates) - 1)] for i in range(k))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeculativeConfig:
        values = cls.checked_keys(data)
        if "method" not in values and values.get("model"):
            values["method"] = "draft_model"  # vLLM: a draft model given without a method
        if isinstance(values.get("synthetic_acceptance_rate"), list):
            values["synthetic_acceptance_rate"] = tuple(values["synthetic_acceptance_rate"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The keys a run's config.json records (JSON-ready)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(data["synthetic_acceptance_rate"], tuple):
            data["synthetic_acceptance_rate"] = list(data["synthetic_acceptance_rate"])
        return data
