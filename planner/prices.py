"""Prices per GPU-hour: the bundled table (``data/prices.yaml``, its source and date inside) with
the user's overrides on top."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import yaml

from twinserve.simulator.hardware import load_hardware

PRICES_FILE = Path(__file__).parent / "data" / "prices.yaml"


@dataclass(frozen=True, slots=True)
class PriceTable:
    """$ per GPU-hour by hardware profile name, and where the figures come from."""

    per_gpu_hour: Mapping[str, float]
    source: str

    def __post_init__(self) -> None:
        prices = {}
        for name, price in dict(self.per_gpu_hour).items():
            prices[_price_key(name)] = check_price(name, price)
        object.__setattr__(self, "per_gpu_hour", MappingProxyType(prices))

    def price(self, hardware: str) -> float:
        """The price of one GPU of ``hardware`` for an hour; ValueError naming it when unknown."""
        key = canonical_hardware(hardware)
        if key not in self.per_gpu_hour:
            raise ValueError(f"price: no price for hardware {hardware!r}; give one with "
                             f"--price {hardware}=DOLLARS (known: {', '.join(self.per_gpu_hour)}).")
        return self.per_gpu_hour[key]

    def with_overrides(self, overrides: Mapping[str, float]) -> PriceTable:
        if not overrides:
            return self
        return PriceTable({**self.per_gpu_hour, **overrides},
                          f"{self.source}; overridden: {', '.join(sorted(overrides))}")


def canonical_hardware(name: str) -> str:
    """The profile's own name (``h100`` -> ``h100-sxm``); ValueError naming an unknown one."""
    try:
        return load_hardware(name).name.lower()
    except ValueError as exc:
        raise ValueError(f"hardware {name!r}: {exc}") from None


def _price_key(name: str) -> str:
    """A price's key: a bundled profile's own name, else the name as given (a calibrated
    profile's, e.g. ``cpu-calibrated``, which only its file can load)."""
    try:
        return canonical_hardware(name)
    except ValueError:
        return name.lower()


def plan_hardware(name: str) -> str:
    """The name a plan carries for a hardware profile: a profile file (a calibrated one) by its
    path as given, a bundled profile by its own name (``h100`` -> ``h100-sxm``)."""
    if Path(name).expanduser().is_file():
        canonical_hardware(name)  # ValueError naming a file that is not a profile
        return name
    return canonical_hardware(name)


def check_price(name: str, price: object) -> float:
    if isinstance(price, bool) or not isinstance(price, (int, float)) or not math.isfinite(price) \
            or price <= 0:
        raise ValueError(f"price of {name!r}: expected dollars per GPU-hour > 0, got {price!r}.")
    return float(price)


def parse_price_flag(text: str) -> tuple[str, float]:
    """``--price h100-sxm=3.5``."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--price {text!r}: expected HARDWARE=DOLLARS, e.g. h100-sxm=3.5.")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"price of {name!r}: expected dollars per GPU-hour, got {value!r}.") from None
    return name, check_price(name, number)


def bundled_prices() -> PriceTable:
    data = yaml.safe_load(PRICES_FILE.read_text(encoding="utf-8"))
    return PriceTable(data["per_gpu_hour"], f"{data['source']} ({data['date']})")
