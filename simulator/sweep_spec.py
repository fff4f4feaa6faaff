"""The sweep spec: a TOML file naming a grid of simulations, and the points it expands to.

```toml
[sweep]
title = "Policies on Azure conv"      # optional: the report's title

[workload]                            # one workload, shared by every point
trace = "azure-conv"                  # bundled name, a .csv/.jsonl file, "synthetic" or "multi-app"
num_requests = 2000                   # the first N (synthetic: how many; default 1000)
time_window = [0.0, 600.0]            # keep arrivals in [start, end) s (before num_requests)
request_rate = 10.0                   # mean req/s: the trace time-scaled to it (synthetic: its rate)
seed = 0                              # every random draw (tenants, priorities, synthetic)
tenants = { heavy = 0.8, light = 0.2 }        # tenant drawn per request with these weights
priorities = { 0 = 0.2, 1 = 0.8 }             # or: priority class drawn per request ...
tenant_priorities = { light = 0, heavy = 1 }  # ... or: priority given by the tenant
loras = "32,base=8"                   # LoRA adapter per request, as --loras (or a count, or a
lora_rank = 16                        #   table of weights); their rank (default max_lora_rank)
lora_target_modules = "all"           #   and modules; serve them with enable_lora in [engine]
clip_max_model_len = 4096             # clip prompt + output to fit (traces.clip_lengths)
# synthetic only: burstiness, input_len, output_len, range_ratio, prefix_len, prefix_share
# multi-app only (applications with their own system prompts, Zipf popularity; the tenant is
# the application): num_apps, zipf_s, system_len_min, system_len_max, and input_len,
# output_len, range_ratio

[engine]                              # fixed engine arguments (vLLM's names) and hardware,
config = "base.yaml"                  # optional: keys of a --config YAML file (these override)
model = "llama-3-8b"
hardware = "h100-sxm"

[grid]                                # axes: any [engine] key, or trace / request_rate / seed
scheduling_policy = ["fcfs", "priority", "fair"]
request_rate = [8, 12, 16]
max_num_seqs = [128, 256]
# a fleet: num_replicas = [2, 4] and router = ["round-robin", "cache-aware"] (on "multi-app")

[slo]                                 # optional: goodput SLOs and the capacity target
ttft_ms = 1000
tpot_ms = 50                          # also e2el_ms
target = 0.9                          # fraction of requests that must meet every SLO

[policy_options.fair]                 # options of one policy, used where that policy runs
w_out = 2.0
```

A request rate scales a real trace's arrival times so that its mean rate, ``(n - 1) / span`` over the
requests kept, equals the rate. The grid is the cartesian product of the axes in the order written;
a point's id is a short hash of its full config (SimConfig fields and resolved workload), so an
unchanged point keeps its id (and run folder) across edits of the rest of the grid.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
import json
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.policies import available_policies, get_policy
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.run import SIM_KEYS, SimConfig, build_engine_config
from twinserve.traces import (
    AdapterShape,
    LoRAAdapters,
    SyntheticConfig,
    TraceRequest,
    assign_loras,
    assign_priorities,
    assign_tenants,
    clip_lengths,
    first_n,
    load_trace,
    scale_time,
    synthetic_trace,
    time_window,
)
from twinserve.traces.lora import parse_loras, parse_target_modules
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace

SECTIONS = ("sweep", "workload", "engine", "grid", "slo", "policy_options")
SYNTHETIC = "synthetic"
SYNTHETIC_KEYS = ("burstiness", "input_len", "output_len", "range_ratio", "prefix_len", "prefix_share")
# The multi-application workload (``traces.multi_app``): its own keys, and the lengths it shares
# with the synthetic trace
MULTI_APP = "multi-app"
MULTI_APP_KEYS = ("num_apps", "zipf_s", "system_len_min", "system_len_max")
MULTI_APP_SHARED = ("input_len", "output_len", "range_ratio")
LORA_KEYS = ("loras", "lora_rank", "lora_target_modules")  # in a point's workload only when set
WORKLOAD_KEYS = ("trace", "num_requests", "time_window", "request_rate", "seed", "tenants",
                 "priorities", "tenant_priorities", "clip_max_model_len", *LORA_KEYS,
                 *SYNTHETIC_KEYS, *MULTI_APP_KEYS)
GENERATED_KEYS = {SYNTHETIC: SYNTHETIC_KEYS, MULTI_APP: MULTI_APP_SHARED + MULTI_APP_KEYS}
WORKLOAD_AXES = ("trace", "request_rate", "seed")
NOT_ENGINE_KEYS = ("policy_options", "label")  # set through [policy_options.<name>] and the grid
# Each [engine]/[grid] key with its type: EngineArgs' fields (as their annotations read) and the
# simulation's own keys.
_KEY_TYPES = {**{f.name: str(f.type) for f in dataclasses.fields(EngineArgs)},
              "hardware": "str", "usage_context": "str", "num_replicas": "int", "router": "str"}
ENGINE_KEYS = tuple(k for k in _KEY_TYPES if k not in NOT_ENGINE_KEYS)
BASE_CONFIG_KEY = "config"  # [engine] config = "base.yaml": engine keys read from a YAML file
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")
DEFAULT_TRACE = "azure-conv"
DEFAULT_SYNTHETIC_REQUESTS = 1000
ID_LENGTH = 10
SPEC_VERSION = 1  # part of every point id: bump when a point's meaning changes


@dataclass(frozen=True, slots=True)
class SloSpec:
    """Latency limits in ms by metric (``ttft``, ``tpot``, ``e2el``) and the fraction of requests
    that must meet all of them for a rate to count as sustained."""

    slos_ms: dict[str, float]
    target: float = 0.9


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One grid point: the SimConfig fields, the resolved workload and this point's axis values."""

    sim: dict[str, Any]
    workload: dict[str, Any]
    axes: dict[str, Any]

    @property
    def point_id(self) -> str:
        """Hash of the resolved engine configuration (so stating a default keeps the id), the
        simulation keys and the resolved workload."""
        cfg = self.sim_config()
        sim = {**build_engine_config(cfg).engine_config.to_dict(),
               **{k: getattr(cfg, k) for k in SIM_KEYS if k != "label"}}
        blob = json.dumps({"version": SPEC_VERSION, "sim": sim, "workload": self.workload},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:ID_LENGTH]

    @property
    def name(self) -> str:
        """Readable: the axis values, e.g. ``fcfs rate12 max_num_seqs=128`` (``point`` if no axis)."""
        return " ".join(_axis_label(k, v) for k, v in self.axes.items()) or "point"

    @property
    def series(self) -> str:
        """The configuration this point belongs to: its name without the request rate."""
        return " ".join(_axis_label(k, v) for k, v in self.axes.items() if k != "request_rate") or "all"

    @property
    def folder(self) -> str:
        """``<name>-<id>`` with anything but letters, digits and ``.=-`` turned into ``_``."""
        return f"{re.sub(r'[^A-Za-z0-9.=-]+', '_', self.name)}-{self.point_id}"

    def sim_config(self) -> SimConfig:
        return SimConfig.from_flat({**self.sim, "label": self.name})


@dataclass(frozen=True, slots=True)
class SweepSpec:
    source: str  # the spec file, named in every error
    title: str
    workload: dict[str, Any]
    engine: dict[str, Any]
    grid: dict[str, list[Any]]
    slo: SloSpec | None
    policy_options: dict[str, dict[str, Any]]

    @property
    def series_keys(self) -> list[str]:
        """The axes that tell configurations apart (every axis but the request rate)."""
        return [k for k in self.grid if k != "request_rate"]

    def points(self) -> list[SweepPoint]:
        """The grid's points, the cartesian product of the axes in the order written."""
        keys = list(self.grid)
        return [self._point(dict(zip(keys, combo)))
                for combo in itertools.product(*(self.grid[k] for k in keys))]

    def _point(self, axes: dict[str, Any]) -> SweepPoint:
        sim = {**self.engine, **{k: v for k, v in axes.items() if k in ENGINE_KEYS}}
        policy = sim.get("scheduling_policy", EngineArgs().scheduling_policy)
        sim["policy_options"] = dict(self.policy_options.get(policy, {}))
        workload = {**self.workload, **{k: v for k, v in axes.items() if k in WORKLOAD_AXES}}
        return SweepPoint(sim=sim, workload=resolve_workload(workload), axes=axes)


def _axis_label(key: str, value: Any) -> str:
    if key == "request_rate":
        return f"rate{value:g}"
    if key in ("scheduling_policy", "trace", "model", "hardware"):
        return Path(str(value)).stem if key == "trace" else str(value)
    return f"{key}={value}"


# ---------------------------------------------------------------- loading and validation


def load_spec(path: str | Path) -> SweepSpec:
    """Reads and validates a spec file; any fault raises ValueError naming the file and the key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such sweep spec file.") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    return parse_spec(data, str(path))


def parse_spec(data: Mapping[str, Any], source: str = "<spec>") -> SweepSpec:
    """Validates a parsed spec (the TOML's tables); ``source`` is named in every error."""
    _check_keys(data, SECTIONS, source, "")
    sections = {name: _table(data, name, source) for name in SECTIONS}
    workload = _parse_workload(sections["workload"], source)
    engine_table = dict(sections["engine"])
    base = engine_table.pop(BASE_CONFIG_KEY, None)
    if base is not None:
        engine_table = {**_base_config(base, source), **engine_table}
    engine = {k: _engine_value(k, v, source, "[engine]") for k, v in engine_table.items()}
    _check_keys(engine, ENGINE_KEYS, source, "[engine]")
    grid = _parse_grid(sections["grid"], source)
    for key in grid:
        if key in engine or key in workload:
            where = "[engine]" if key in engine else "[workload]"
            raise ValueError(f"{source}: [grid] {key}: also given in {where}; give it in one place.")
    spec = SweepSpec(source=source, title=_title(sections["sweep"], source), workload=workload,
                     engine=engine, grid=grid, slo=_parse_slo(sections["slo"], source),
                     policy_options=_parse_policy_options(sections["policy_options"], source))
    _check_points(spec)
    return spec


def _check_keys(table: Mapping[str, Any], valid: tuple[str, ...], source: str, where: str) -> None:
    for key in table:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; valid: {', '.join(valid)}"
            raise ValueError(f"{source}: {where + ' ' if where else ''}unknown key {key!r}{hint}")


def _table(data: Mapping[str, Any], name: str, source: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"{source}: [{name}] must be a table, got {value!r}.")
    return value


def _title(sweep: dict[str, Any], source: str) -> str:
    _check_keys(sweep, ("title",), source, "[sweep]")
    title = sweep.get("title", "twinserve sweep")
    if not isinstance(title, str):
        raise ValueError(f"{source}: [sweep] title must be a string, got {title!r}.")
    return title


def _fail(source: str, where: str, key: str, message: str) -> ValueError:
    return ValueError(f"{source}: {where} {key}: {message}")


# ---------------------------------------------------------------- [engine] values


def _base_config(path: Any, source: str) -> dict[str, Any]:
    """The keys of the YAML file ``[engine] config`` names (relative to the spec's folder),
    with dashes read as underscores; the [engine] table's own keys override them."""
    import yaml
    if not isinstance(path, str):
        raise _fail(source, "[engine]", BASE_CONFIG_KEY, f"expected a file name, got {path!r}.")
    file = Path(source).parent / path if not Path(path).is_absolute() else Path(path)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise _fail(source, "[engine]", BASE_CONFIG_KEY, f"cannot read {file}: {exc}") from None
    if not isinstance(data, dict):
        raise _fail(source, "[engine]", BASE_CONFIG_KEY, f"{file} must hold a mapping.")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _engine_value(key: str, value: Any, source: str, where: str) -> Any:
    """An engine key's value, type-checked against its annotation (ints widen to float)."""
    valid = ENGINE_KEYS + WORKLOAD_AXES if where == "[grid]" else ENGINE_KEYS
    _check_keys({key: value}, valid, source, where)
    base = _KEY_TYPES[key].replace(" | None", "")
    if base == "float" and _is_number(value):
        return float(value)
    expected = {"int": int, "bool": bool, "str": str}.get(base)
    if expected is None or type(value) is not expected:
        raise _fail(source, where, key, f"expected {base}, got {value!r}.")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------- [workload]


def _parse_workload(table: dict[str, Any], source: str) -> dict[str, Any]:
    _check_keys(table, WORKLOAD_KEYS, source, "[workload]")
    return {key: _workload_value(key, value, source, "[workload]") for key, value in table.items()}


def _workload_value(key: str, value: Any, source: str, where: str) -> Any:
    """A workload setting, checked and normalised (rates to float, priority keys to int)."""
    checker = WORKLOAD_CHECKS.get(key)
    if checker is None:  # a generated trace's setting: its config judges it
        checker = _multi_app_setting(key) if key in MULTI_APP_KEYS else _synthetic_setting(key)
    try:
        return checker(value)
    except (ValueError, TypeError) as exc:
        raise _fail(source, where, key, str(exc)) from None


def _int_at_least(minimum: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {value!r}.")
        return value
    return check


def _rate(value: Any) -> float:
    if not _is_number(value) or not value > 0:
        raise ValueError(f"expected a number > 0 (req/s), got {value!r}.")
    return float(value)


def _trace_name(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a trace name or file path, got {value!r}.")
    return value


def _window(value: Any) -> list[float]:
    if (not isinstance(value, list) or len(value) != 2 or not all(_is_number(v) for v in value)
            or not 0 <= value[0] < value[1]):
        raise ValueError(f"expected [start, end] seconds with 0 <= start < end, got {value!r}.")
    return [float(value[0]), float(value[1])]


def _weights(value: Any) -> dict[str, float]:
    if not isinstance(value, dict) or not value:
        raise ValueError(f"expected a table of name = weight, got {value!r}.")
    for name, weight in value.items():
        if not _is_number(weight) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weight of {name!r} must be a finite number >= 0, got {weight!r}.")
    if sum(value.values()) <= 0:
        raise ValueError("weights must not all be 0.")
    return {str(k): float(v) for k, v in value.items()}


def _priority_weights(value: Any) -> dict[int, float]:
    weights = _weights(value)
    try:
        return {int(k): v for k, v in weights.items()}
    except ValueError:
        raise ValueError(f"priority classes must be integers, got {list(weights)}.") from None


def _tenant_priorities(value: Any) -> dict[str, int]:
    if not isinstance(value, dict) or not value:
        raise ValueError(f"expected a table of tenant = priority, got {value!r}.")
    for tenant, prio in value.items():
        if isinstance(prio, bool) or not isinstance(prio, int):
            raise ValueError(f"priority of {tenant!r} must be an integer, got {prio!r}.")
    return dict(value)


def _synthetic_setting(key: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not _is_number(value):
            raise ValueError(f"expected a number, got {value!r}.")
        SyntheticConfig(**{key: value})
        return value
    return check


def _multi_app_setting(key: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not _is_number(value):
            raise ValueError(f"expected a number, got {value!r}.")
        if key != "system_len_max":  # (checked against the minimum with the whole workload)
            MultiAppConfig(**{key: value})
        return value
    return check


def _loras(value: Any) -> str:
    """``--loras`` text, from a count, that text, or a table of weights."""
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
    elif isinstance(value, str):
        text = value
    elif isinstance(value, dict):
        text = ",".join(f"{name}={weight}" for name, weight in _weights(value).items())
    else:
        raise ValueError(f"expected a count, --loras text or a table of weights, got {value!r}.")
    parse_loras(text)
    return text


def _target_modules(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    if not isinstance(value, str):
        raise ValueError(f"expected 'all' or a list of module names, got {value!r}.")
    return ",".join(parse_target_modules(value))


WORKLOAD_CHECKS: dict[str, Callable[[Any], Any]] = {
    "trace": _trace_name, "num_requests": _int_at_least(1), "time_window": _window,
    "request_rate": _rate, "seed": _int_at_least(0), "tenants": _weights,
    "priorities": _priority_weights, "tenant_priorities": _tenant_priorities,
    "clip_max_model_len": _int_at_least(2), "loras": _loras, "lora_rank": _int_at_least(1),
    "lora_target_modules": _target_modules,
}


def resolve_workload(workload: dict[str, Any]) -> dict[str, Any]:
    """Every workload key with its value or ``None`` (a generated trace's keys only for that
    trace, ``GENERATED_KEYS``), so that a point's id does not depend on which defaults were
    written out."""
    trace = workload.get("trace", DEFAULT_TRACE)
    own = GENERATED_KEYS.get(trace, ())
    keys = [k for k in WORKLOAD_KEYS if (k in own or k not in SYNTHETIC_KEYS + MULTI_APP_KEYS)
            and (k not in LORA_KEYS or workload.get(k) is not None)]  # ids of LoRA-less points stay
    resolved = {k: workload.get(k) for k in keys}
    resolved["trace"] = trace
    resolved["seed"] = workload.get("seed", 0)
    return resolved


# ---------------------------------------------------------------- [grid], [slo], [policy_options]


def _parse_grid(table: dict[str, Any], source: str) -> dict[str, list[Any]]:
    grid: dict[str, list[Any]] = {}
    for key, values in table.items():
        if not isinstance(values, list) or not values:
            raise _fail(source, "[grid]", key, f"expected a non-empty list of values, got {values!r}.")
        checked = [_workload_value(key, v, source, "[grid]") if key in WORKLOAD_AXES
                   else _engine_value(key, v, source, "[grid]") for v in values]
        if len({json.dumps(v, sort_keys=True) for v in checked}) < len(checked):
            raise _fail(source, "[grid]", key, f"values repeat: {values!r}.")
        grid[key] = checked
    return grid


def _parse_slo(table: dict[str, Any], source: str) -> SloSpec | None:
    _check_keys(table, (*SLO_KEYS, "target"), source, "[slo]")
    slos = {}
    for key in SLO_KEYS:
        if key in table:
            value = table[key]
            if not _is_number(value) or not value > 0:
                raise _fail(source, "[slo]", key, f"expected a number of ms > 0, got {value!r}.")
            slos[key.removesuffix("_ms")] = float(value)
    target = table.get("target", 0.9)
    if not _is_number(target) or not 0 < target <= 1:
        raise _fail(source, "[slo]", "target", f"expected a fraction in (0, 1], got {target!r}.")
    if not slos:
        if table:
            raise ValueError(f"{source}: [slo] needs at least one of {', '.join(SLO_KEYS)}.")
        return None
    return SloSpec(slos_ms=slos, target=float(target))


def _parse_policy_options(table: dict[str, Any], source: str) -> dict[str, dict[str, Any]]:
    known = tuple(available_policies())
    _check_keys(table, known, source, "[policy_options]")
    options = {}
    for name, opts in table.items():
        if not isinstance(opts, dict):
            raise _fail(source, "[policy_options]", name, f"expected a table of options, got {opts!r}.")
        try:
            get_policy(name, **opts)
        except ValueError as exc:
            raise _fail(source, "[policy_options]", name, str(exc)) from None
        options[name] = opts
    return options


def _check_points(spec: SweepSpec) -> None:
    """Builds every point's SimConfig and checks the names it uses, naming the key at fault."""
    for point in spec.points():
        where = {k: "[grid]" if k in spec.grid else "[engine]" for k in point.sim}
        checks: tuple[tuple[str, Callable[[Any], object]], ...] = (
            ("model", load_model_spec), ("hardware", load_hardware),
            ("scheduling_policy", get_policy))
        for key, check in checks:
            if key in point.sim:
                _run_check(spec.source, where[key], key, partial(check, point.sim[key]))
        _run_check(spec.source, "[engine]/[grid]", "SimConfig", point.sim_config)
        _check_workload(spec, point.workload)
    traces = {p.workload["trace"] for p in spec.points()}
    for key in spec.workload:
        takers = [t for t, keys in GENERATED_KEYS.items() if key in keys]
        if takers and not traces & set(takers):
            raise _fail(spec.source, "[workload]", key, "applies only to trace = "
                        + " or ".join(map(repr, takers)) + ".")


def _run_check(source: str, where: str, key: str, check: Callable[[], Any]) -> None:
    try:
        check()
    except ValueError as exc:
        raise _fail(source, where, key, str(exc)) from None


def _check_workload(spec: SweepSpec, workload: dict[str, Any]) -> None:
    if workload["priorities"] is not None and workload["tenant_priorities"] is not None:
        raise _fail(spec.source, "[workload]", "tenant_priorities", "give priorities or "
                    "tenant_priorities, not both.")
    rate = workload["request_rate"]
    if workload["trace"] != SYNTHETIC and rate is not None and not math.isfinite(rate):
        where = "[grid]" if "request_rate" in spec.grid else "[workload]"
        raise _fail(spec.source, where, "request_rate",
                    f"must be finite for trace {workload['trace']!r}.")
    if workload["trace"] == MULTI_APP:
        _run_check(spec.source, "[workload]", "system_len_max", lambda: _multi_app_config(workload))


# ---------------------------------------------------------------- a point's requests


def base_trace(workload: dict[str, Any]) -> list[TraceRequest] | None:
    """The loaded trace a point's requests are cut from (``None`` for a generated workload)."""
    return None if workload["trace"] in GENERATED_KEYS else load_trace(workload["trace"])


def point_trace(workload: dict[str, Any], base: list[TraceRequest] | None) -> list[TraceRequest]:
    """A point's requests: source, time window, first N, request rate, tenants, priorities, clipping
    (the order of ``traces.cli_args``)."""
    reqs = base if base is not None else multi_app_trace(_multi_app_config(workload)) \
        if workload["trace"] == MULTI_APP else _synthetic(workload)
    if workload["time_window"] is not None:
        reqs = time_window(reqs, *workload["time_window"])
    if base is not None and workload["num_requests"] is not None:
        reqs = first_n(reqs, workload["num_requests"])
    if base is not None and workload["request_rate"] is not None:
        reqs = _at_rate(reqs, workload["request_rate"])
    if not reqs:
        raise ValueError(f"[workload]: no request left of trace {workload['trace']!r}.")
    return _labelled(reqs, workload)


def _at_rate(reqs: list[TraceRequest], rate: float) -> list[TraceRequest]:
    native = mean_rate(reqs)
    if not math.isfinite(native):
        raise ValueError("[workload] request_rate: the requests kept span no time, so they cannot "
                         "be time-scaled to a rate.")
    return scale_time(reqs, rate / native)


def _synthetic(workload: dict[str, Any]) -> list[TraceRequest]:
    given = {k: workload[k] for k in SYNTHETIC_KEYS if workload[k] is not None}
    if workload["request_rate"] is not None:
        given["request_rate"] = workload["request_rate"]
    num = workload["num_requests"] or DEFAULT_SYNTHETIC_REQUESTS
    return synthetic_trace(SyntheticConfig(num_requests=num, seed=workload["seed"], **given))


def _multi_app_config(workload: dict[str, Any]) -> MultiAppConfig:
    """A multi-application point's workload (``traces.multi_app``), defaults where not given."""
    given = {k: workload[k] for k in GENERATED_KEYS[MULTI_APP] if workload.get(k) is not None}
    if workload["request_rate"] is not None:
        given["request_rate"] = workload["request_rate"]
    num = workload["num_requests"] or DEFAULT_SYNTHETIC_REQUESTS
    return MultiAppConfig(num_requests=num, seed=workload["seed"], **given)


def _labelled(reqs: list[TraceRequest], workload: dict[str, Any]) -> list[TraceRequest]:
    seed = workload["seed"]
    if workload["tenants"] is not None:
        reqs = assign_tenants(reqs, workload["tenants"], seed=seed)
    if workload["priorities"] is not None:
        reqs = assign_priorities(reqs, workload["priorities"], seed=seed)
    if workload.get("loras") is not None:
        reqs = assign_loras(reqs, parse_loras(workload["loras"])[0], seed=seed)
    by_tenant = workload["tenant_priorities"]
    if by_tenant is not None:
        reqs = [dataclasses.replace(r, priority=by_tenant.get(r.tenant, r.priority)) for r in reqs]
    if workload["clip_max_model_len"] is not None:
        reqs = clip_lengths(reqs, workload["clip_max_model_len"])
    return reqs


def point_adapters(workload: dict[str, Any], engine: EngineArgs) -> LoRAAdapters | None:
    """The shapes of a point's adapters (``None`` with LoRA disabled): ``lora_rank`` (default the
    engine's max_lora_rank), ``lora_target_modules`` and the ranks ``loras`` gives."""
    lora = engine.lora_config()
    if lora is None:
        return None
    rank = workload.get("lora_rank") or lora.max_lora_rank
    modules = parse_target_modules(workload.get("lora_target_modules") or "all")
    ranks = parse_loras(workload["loras"])[1] if workload.get("loras") else {}
    return LoRAAdapters(AdapterShape(rank, modules), tuple(ranks.items()))


def mean_rate(reqs: list[TraceRequest]) -> float:
    """Mean arrival rate ``(n - 1) / span`` in req/s (``nan`` when the requests span no time)."""
    if len(reqs) < 2:
        return math.nan
    span = reqs[-1].arrival_time - reqs[0].arrival_time
    return (len(reqs) - 1) / span if span > 0 else math.nan
