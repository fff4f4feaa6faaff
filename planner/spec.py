"""A plan's inputs: from the command line or a TOML/YAML spec file (the same keys), validated in
one place; every fault raises ValueError naming the key (and the file).

```yaml
model: llama-3-8b
hardware: [a100-80gb, h100-sxm, h200]
max_gpus: 8
attainment: 0.9                 # fraction for SLO keys without a percentile
workload: {trace: azure-conv, num_requests: 5000, duration_s: 120}   # see search.replay_requests
# or generated, applications with their own system prompts (routers differ on it):
# workload: {trace: multi-app, num_apps: 400, zipf_s: 0.8, system_len_min: 256,
#            system_len_max: 2048, input_len: 256, output_len: 128, seed: 0}
slo: {ttft_p90_ms: 2000, tpot_p99_ms: 100}
space:                          # axes (defaults: PlanSpace's)
  tensor_parallel_size: [1, 2, 4, 8]
  pipeline_parallel_size: [1, 2]
  replicas: [1, 2, 4, 8]        # default: every count within max_gpus
  router: [round-robin, cache-aware]
  max_num_seqs: [128, 256]
  max_num_batched_tokens: [2048, 8192]
  enable_chunked_prefill: [true, false]
  scheduling_policy: [fcfs]
  speculation: ["off", ngram]   # or speculative_config mappings
  quantization: [none, fp8]
  disaggregation: ["off", 1P1D, 2P1D]   # aggregated and/or xPyD (prefill x, decode y instances)
  max_pd_instances: 4           # adds every xPyD with x + y <= 4
  kv_link: [auto]               # auto: the profile's link within a node, InfiniBand across
  prefill_max_num_batched_tokens: [none, 8192]   # xPyD pools' own limits (none: the above)
  decode_max_num_seqs: [none, 512]               # also prefill_max_num_seqs, decode_max_num_batched_tokens
engine: {gpu_memory_utilization: 0.9}   # fixed engine arguments
prices: {h100-sxm: 3.5}         # $ per GPU-hour over the bundled table
search: {tolerance: 0.05, base_rps: 1.0, min_rps: 0.05, max_rps: 1000,
         dominance_slack: 1.5, early_stop: true, acceptance_profile: null}
```
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from twinserve.planner.prices import PriceTable, bundled_prices, check_price, plan_hardware
from twinserve.planner.search import RateGrid
from twinserve.planner.slo import Slo, parse_slo
from twinserve.planner.space import AGGREGATED, POOL_COLUMNS, PlanSpace

TOP_KEYS = ("model", "hardware", "max_gpus", "attainment", "workload", "slo", "space", "engine",
            "prices", "search")
MULTI_APP = "multi-app"
# the multi-application workload's settings (``traces.multi_app.MultiAppConfig``'s names)
MULTI_APP_KEYS = ("num_apps", "zipf_s", "system_len_min", "system_len_max", "input_len",
                  "output_len", "range_ratio", "seed")
MULTI_APP_REQUESTS = 10_000  # generated where num_requests is not given
WORKLOAD_KEYS = ("trace", "num_requests", "duration_s", *MULTI_APP_KEYS)
SPACE_KEYS = {"tensor_parallel_size": "tensor_parallel_sizes",
              "pipeline_parallel_size": "pipeline_parallel_sizes", "replicas": "replicas",
              "router": "routers", "max_num_seqs": "max_num_seqs",
              "max_num_batched_tokens": "max_num_batched_tokens",
              "enable_chunked_prefill": "enable_chunked_prefill",
              "scheduling_policy": "scheduling_policies", "speculation": "speculative_configs",
              "quantization": "quantizations", "gpus_per_node": "gpus_per_node",
              "disaggregation": "disaggregation", "max_pd_instances": "max_pd_instances",
              "kv_link": "kv_links", **{name: name for name in POOL_COLUMNS}}
SCALAR_SPACE_KEYS = ("gpus_per_node", "max_pd_instances")
SEARCH_KEYS = ("tolerance", "base_rps", "min_rps", "max_rps", "dominance_slack", "early_stop",
               "acceptance_profile")
DEFAULT_DURATION_S = 120.0  # of arrivals per replay, whatever its rate
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}  # "ngram" on the speculation axis


@dataclass(frozen=True, slots=True)
class PlanSpec:
    space: PlanSpace
    slos: tuple[Slo, ...]
    trace: str
    num_requests: int | None
    duration_s: float | None
    prices: PriceTable
    grid: RateGrid
    dominance_slack: float = 1.5
    early_stop: bool = True
    acceptance_profile: tuple[str, ...] = ()  # measured profiles, merged where several
    source: str = "<plan>"
    # a generated workload's settings (``trace`` multi-app: MULTI_APP_KEYS given), as pairs
    trace_options: tuple[tuple[str, Any], ...] = ()

    def price(self, hardware: str) -> float:
        return self.prices.price(hardware)


def load_plan_file(path: str | Path) -> dict[str, Any]:
    """A spec file's mapping (``.toml``, else YAML)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such plan spec file.") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: "
                         f"{exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a mapping of plan keys.")
    return data


def parse_plan(data: Mapping[str, Any], source: str = "<plan>") -> PlanSpec:
    """Validates a plan's mapping; ``source`` is named in every error."""
    try:
        return _parse(data)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _parse(data: Mapping[str, Any]) -> PlanSpec:
    _check_keys(data, TOP_KEYS, "")
    for key in ("model", "hardware", "max_gpus", "slo"):
        if key not in data:
            raise ValueError(f"{key}: required.")
    attainment = data.get("attainment", 0.9)
    if isinstance(attainment, bool) or not isinstance(attainment, (int, float)) \
            or not 0 < attainment <= 1:
        raise ValueError(f"attainment: expected a fraction in (0, 1], got {attainment!r}.")
    slo_table = _table(data, "slo")
    if not slo_table:
        raise ValueError("slo: at least one SLO is needed, e.g. ttft_p90_ms: 2000.")
    slos = tuple(parse_slo(str(k), v, float(attainment)) for k, v in slo_table.items())
    workload = _table(data, "workload")
    _check_keys(workload, WORKLOAD_KEYS, "workload")
    num = workload.get("num_requests")
    if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 2):
        raise ValueError(f"workload.num_requests: expected an integer >= 2, got {num!r}.")
    trace = str(workload.get("trace", "azure-conv"))
    options = _trace_options(workload, trace, num)
    duration = workload.get("duration_s", DEFAULT_DURATION_S)
    if duration is not None:
        duration = _number("workload.duration_s", duration)
        if duration <= 0:
            raise ValueError(f"workload.duration_s: expected seconds > 0, got {duration!r}.")
    search = _table(data, "search")
    _check_keys(search, SEARCH_KEYS, "search")
    grid = RateGrid(**{k: _number(f"search.{k}", search[k]) for k in
                       ("tolerance", "base_rps", "min_rps", "max_rps") if k in search})
    slack = _number("search.dominance_slack", search.get("dominance_slack", 1.5))
    if slack < 0:
        raise ValueError(f"search.dominance_slack: expected a number >= 0, got {slack!r}.")
    early = search.get("early_stop", True)
    if not isinstance(early, bool):
        raise ValueError(f"search.early_stop: expected true or false, got {early!r}.")
    prices = {str(k): check_price(str(k), v) for k, v in _table(data, "prices").items()}
    space = _space(data)
    table = bundled_prices().with_overrides(prices)
    for hardware in space.hardware:
        table.price(hardware)  # ValueError naming a GPU without a price
    profile = search.get("acceptance_profile")
    files = [profile] if isinstance(profile, str) else profile
    if profile is not None and (not isinstance(files, list) or not files
                                or not all(isinstance(f, str) and f for f in files)):
        raise ValueError(f"search.acceptance_profile: expected a file name or a list of them "
                         f"(merged), got {profile!r}.")
    return PlanSpec(space, slos, trace, num, duration, table, grid, slack, early,
                    tuple(files or ()), trace_options=options)


def _trace_options(workload: Mapping[str, Any], trace: str,
                   num: int | None) -> tuple[tuple[str, Any], ...]:
    """The multi-application workload's settings (refused by name for any other trace),
    checked by building its config."""
    from twinserve.traces.multi_app import checked_config
    given = {k: workload[k] for k in MULTI_APP_KEYS if k in workload}
    if trace != MULTI_APP:
        if given:
            raise ValueError(f"workload.{next(iter(given))}: applies only to trace {MULTI_APP}.")
        return ()
    checked_config(num or MULTI_APP_REQUESTS, given, name=lambda key: f"workload.{key}")
    return tuple(given.items())


def _space(data: Mapping[str, Any]) -> PlanSpace:
    hardware = data["hardware"]
    hardware = hardware.split(",") if isinstance(hardware, str) else hardware
    if not isinstance(hardware, list) or not all(isinstance(h, str) for h in hardware):
        raise ValueError(f"hardware: expected a list of profile names, got {hardware!r}.")
    names = tuple(dict.fromkeys(plan_hardware(h.strip()) for h in hardware))
    axes = _table(data, "space")
    _check_keys(axes, tuple(SPACE_KEYS), "space")
    kwargs: dict[str, Any] = {}
    for key, value in axes.items():
        if key in SCALAR_SPACE_KEYS:
            kwargs[SPACE_KEYS[key]] = value
            continue
        values = value if isinstance(value, list) else [value]
        if key == "speculation":
            values = [_speculation(v) for v in values]
        elif key == "quantization":
            values = [None if v in (None, "none", "off") else v for v in values]
        elif key == "disaggregation":  # (YAML reads a bare off as false)
            values = [AGGREGATED if v is False else v for v in values]
        elif key in POOL_COLUMNS:  # none: the deployment's own value
            values = [None if v in (None, "none") else v for v in values]
        kwargs[SPACE_KEYS[key]] = tuple(values)
    model = data["model"]
    if not isinstance(model, str):
        raise ValueError(f"model: expected a bundled name or config path, got {model!r}.")
    engine = _table(data, "engine")
    return PlanSpace(model=model, hardware=names, max_gpus=data["max_gpus"], fixed=dict(engine),
                     **kwargs)


def _speculation(value: Any) -> dict[str, Any] | None:
    if value in (None, "off", "none", False):
        return None
    if value == "ngram":
        return dict(NGRAM)
    if isinstance(value, dict):
        return dict(value)
    raise ValueError(f"space.speculation: expected off, ngram or a speculative_config mapping, "
                     f"got {value!r}.")


def _check_keys(table: Mapping[str, Any], valid: tuple[str, ...], where: str) -> None:
    for key in table:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; valid: {', '.join(valid)}"
            raise ValueError(f"{where + '.' if where else ''}{key}: unknown key{hint}")


def _table(data: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name) or {}
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a mapping, got {value!r}.")
    return value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {value!r}.")
    return float(value)
