"""Command-line flags that pick and shape a workload, shared by every entry point that replays one.

``trace_from_args`` applies them in this order:

1. ``--trace``: a bundled trace, a file, ``synthetic`` (built from ``--num-requests``,
   ``--request-rate``, ``--burstiness``, ``--input-len``, ``--output-len``, ``--range-ratio``,
   ``--prefix-len``, ``--prefix-share`` and ``--seed``; those flags are refused with a real trace)
   or ``multi-app`` (``traces.multi_app``: ``--num-apps``, ``--zipf-s``, ``--system-len-min``,
   ``--system-len-max``, and the rate, lengths and seed flags as for ``synthetic``);
2. ``--time-window START:END`` (seconds of the trace, re-based to 0);
3. ``--num-requests N`` (the first N, for a real trace);
4. ``--time-scale K`` (K times the rate);
5. ``--tenants name=weight,...`` then ``--priorities prio=weight,...`` then ``--loras`` (seeded
   draws, ``--seed``; ``--loras`` only where ``add_lora_args`` added it: see ``traces.lora``);
6. ``--max-output-tokens`` and ``--max-model-len`` (``clip_lengths``: outputs capped first, then
   prompts shortened to leave room for them).
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from twinserve.traces.cli_flags import MULTI_APP, MULTI_APP_FLAGS, SYNTHETIC, SYNTHETIC_FLAGS
from twinserve.traces.errors import TraceError
from twinserve.traces.loaders import load_trace
from twinserve.traces.lora import AdapterShape, LoRAAdapters, assign_loras, parse_loras, parse_target_modules
from twinserve.traces.multi_app import checked_config, multi_app_trace
from twinserve.traces.synthetic import SyntheticConfig, synthetic_trace
from twinserve.traces.trace_request import TraceRequest
from twinserve.traces.transforms import (
    assign_priorities,
    assign_tenants,
    clip_lengths,
    first_n,
    scale_time,
    time_window,
)

K = TypeVar("K", str, int)
# Flags of the generated workloads, each one's or both's
_GENERATED_FLAGS = tuple(dict.fromkeys((*SYNTHETIC_FLAGS, *MULTI_APP_FLAGS)))


def lora_adapters_from_args(args: argparse.Namespace,
                            default_rank: int = 16) -> LoRAAdapters:
    """The adapters' shapes from ``add_lora_args``' flags (``default_rank`` without
    ``--lora-rank``: the engine's max_lora_rank)."""
    with _flag("--lora-target-modules"):
        modules = parse_target_modules(getattr(args, "lora_target_modules", None) or "all")
    rank = getattr(args, "lora_rank", None)
    with _flag("--lora-rank"):
        default = AdapterShape(default_rank if rank is None else rank, modules)
    ranks: dict[str, int] = {}
    if getattr(args, "loras", None) is not None:
        with _flag("--loras"):
            ranks = parse_loras(args.loras)[1]
    with _flag("--loras"):
        return LoRAAdapters(default, tuple(ranks.items()))


@contextlib.contextmanager
def _flag(name: str) -> Iterator[None]:
    """Re-raises a ValueError from inside as one that names the flag (a TraceError passes unchanged)."""
    try:
        yield
    except TraceError:
        raise
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def trace_desc(args: argparse.Namespace) -> dict[str, object]:
    """The workload flags that were given, for a run folder's config (what reruns the workload)."""
    keys = ("trace", "num_requests", "time_window", "time_scale", *_GENERATED_FLAGS, "tenants",
            "priorities", "loras", "lora_rank", "lora_target_modules", "max_model_len",
            "max_output_tokens", "seed")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def trace_from_args(args: argparse.Namespace) -> list[TraceRequest]:
    """The workload the flags describe, transformed in the documented order."""
    if isinstance(args.seed, bool) or not isinstance(args.seed, int) or args.seed < 0:
        raise ValueError(f"--seed must be an integer >= 0, got {args.seed!r}.")
    reqs = _source(args)
    if args.time_window is not None:
        with _flag("--time-window"):
            reqs = time_window(reqs, *parse_window(args.time_window))
    if args.num_requests is not None and args.trace not in (SYNTHETIC, MULTI_APP):
        with _flag("--num-requests"):
            reqs = first_n(reqs, args.num_requests)
    if args.time_scale is not None:
        with _flag("--time-scale"):
            reqs = scale_time(reqs, args.time_scale)
    if args.tenants is not None:
        with _flag("--tenants"):
            reqs = assign_tenants(reqs, parse_weights(args.tenants, str), seed=args.seed)
    if args.priorities is not None:
        with _flag("--priorities"):
            reqs = assign_priorities(reqs, parse_weights(args.priorities, int), seed=args.seed)
    if getattr(args, "loras", None) is not None:
        with _flag("--loras"):
            reqs = assign_loras(reqs, parse_loras(args.loras)[0], seed=args.seed)
    if args.max_model_len is not None or args.max_output_tokens is not None:
        flag = "--max-model-len" if args.max_model_len is not None else "--max-output-tokens"
        with _flag(flag):
            reqs = clip_lengths(reqs, args.max_model_len or 1 << 30, args.max_output_tokens)
    return reqs


def _source(args: argparse.Namespace) -> list[TraceRequest]:
    given = {dest: getattr(args, dest) for dest in _GENERATED_FLAGS
             if getattr(args, dest, None) is not None}
    if args.trace == MULTI_APP:
        return _multi_app(args, given)
    if args.trace != SYNTHETIC:
        if given:
            dest = next(iter(given))
            raise ValueError(f"--{dest.replace('_', '-')} applies only to --trace "
                             f"{SYNTHETIC if dest in SYNTHETIC_FLAGS else MULTI_APP}.")
        n = args.num_requests  # read only the first N where they are what step 3 keeps
        limit = n if args.time_window is None and type(n) is int and n >= 1 else None
        with _flag("--trace"):
            return load_trace(args.trace, limit=limit)
    with _flag("--num-requests"):
        num = 1000 if args.num_requests is None else args.num_requests
        SyntheticConfig(num_requests=num)
    for dest, value in given.items():  # validate one flag at a time so the error names it
        with _flag("--" + dest.replace("_", "-")):
            if dest not in SYNTHETIC_FLAGS:
                raise ValueError(f"applies only to --trace {MULTI_APP}.")
            SyntheticConfig(**{dest: value})
    return synthetic_trace(SyntheticConfig(num_requests=num, seed=args.seed, **given))


def _multi_app(args: argparse.Namespace, given: dict[str, Any]) -> list[TraceRequest]:
    """The multi-application workload (``traces.multi_app``) from its flags."""
    for dest in given:
        if dest not in MULTI_APP_FLAGS:
            raise ValueError(f"--{dest.replace('_', '-')}: applies only to --trace {SYNTHETIC}.")
    num = 1000 if args.num_requests is None else args.num_requests
    return multi_app_trace(checked_config(num, given, args.seed,
                                          lambda key: "--" + key.replace("_", "-")))


def parse_window(text: str) -> tuple[float, float]:
    """``"START:END"`` -> (start, end) seconds; END may be empty (= no end)."""
    start, sep, end = text.partition(":")
    if not sep:
        raise ValueError(f"expected START:END in seconds, got {text!r}.")
    try:
        return float(start or 0.0), float(end) if end else math.inf
    except ValueError:
        raise ValueError(f"expected START:END in seconds, got {text!r}.") from None


def parse_weights(text: str, key_type: Callable[[str], K]) -> dict[K, float]:
    """``"a=3,b=1"`` -> {"a": 3.0, "b": 1.0} with keys converted by ``key_type``."""
    weights: dict[K, float] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            weights[key_type(key.strip())] = float(value)
        except ValueError:
            raise ValueError(f"expected KEY=WEIGHT,... got {item!r} in {text!r}.") from None
    return weights
