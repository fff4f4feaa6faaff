"""Per-pool engine arguments of a disaggregated deployment (``prefill_args``, ``decode_args``).

vLLM runs each pool as its own ``serve`` with its own flags, and DistServe tunes each pool for
its phase (a prefill pool wants a large token budget, a decode pool many sequences). A pool's
arguments are overrides of the deployment's engine arguments, under the same names as a
``--config`` file's keys. Some must be equal in both pools, and are refused in a pool's: the
KV cache a decode instance loads is the prefill instance's, block for block (``model``,
``dtype``, ``block_size``, ``kv_cache_dtype``), and the deployment itself sets the connector and
the instances (``kv_transfer_config``, ``kv_offloading_size``, ``data_parallel_size``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from twinserve.core.engine_args import NOT_IMPLEMENTED, EngineArgs, check_not_implemented

SHARED_BY_POOLS = ("model", "dtype", "block_size", "kv_cache_dtype", "kv_transfer_config",
                   "kv_offloading_size", "data_parallel_size")
POOL_ARG_NAMES = ("prefill_args", "decode_args")


def check_pool_args(value: Mapping[str, Any] | str | None, name: str) -> dict[str, Any]:
    """A pool's overrides from a mapping or JSON text (``{}`` for None), keys with underscores.
    ValueError naming ``name`` and the key: not a mapping, an unknown key, a key both pools
    must share, or an argument twinserve does not implement set to a real value."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a mapping of engine arguments, got "
                         f"{type(value).__name__}.")
    known = set(EngineArgs.field_names())
    out: dict[str, Any] = {}
    for raw_key, item in value.items():
        key = str(raw_key).replace("-", "_")
        if key in NOT_IMPLEMENTED:
            check_not_implemented(key, item, name)
            continue
        if key not in known:
            raise ValueError(f"{name}: unknown engine argument {raw_key!r}; valid: "
                             f"{', '.join(sorted(known - set(SHARED_BY_POOLS)))}.")
        if key in SHARED_BY_POOLS:
            raise ValueError(f"{name}: {key!r} must be the same in both pools; give it for the "
                             "whole deployment, not per pool.")
        out[key] = item
    return out


def pool_engine_args(args: EngineArgs, overrides: Mapping[str, Any], name: str) -> EngineArgs:
    """``args`` with a pool's (checked) overrides; a bad value raises ValueError naming
    ``name`` and the argument."""
    if not overrides:
        return args
    try:
        return args.replace(**overrides)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
