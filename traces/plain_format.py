"""twinserve's plain trace format, one row per request (CSV with a header, or JSONL objects).

Columns: ``arrival_time_s`` (seconds, any origin), ``input_tokens``, ``output_tokens`` and optionally
``tenant`` (default ``"default"``), ``priority`` (default 0), ``prefix_group`` and ``prefix_tokens``, and
``lora`` (or ``adapter``: the LoRA adapter's name; empty: the base model).
Requests with the same non-empty ``prefix_group`` share their first ``prefix_tokens`` prompt tokens
(required with a group; ``1 <= prefix_tokens <= input_tokens``; a group's shorter prefixes are prefixes of
its longer ones). An empty CSV cell, or a JSON ``null``, means the column's default.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from twinserve.traces.trace_request import MAX_BLOCK_ID, stable_seed

# A parsed row: (arrival in seconds, keyword arguments of TraceRequest other than id and arrival).
Parsed = tuple[float, dict]
RowParser = Callable[[dict], Parsed]
LORA_COLUMNS = ("lora", "adapter")  # the adapter's column, by either name


def parse_plain_row(row: dict) -> Parsed:
    """One plain-format row -> (arrival seconds, request fields). Raises KeyError/ValueError."""
    arrival = float_field(row, "arrival_time_s")
    fields: dict = {"input_tokens": int_field(row, "input_tokens"),
                    "output_tokens": int_field(row, "output_tokens")}
    if _given(row, "tenant"):
        fields["tenant"] = str(row["tenant"])
    if _given(row, "priority"):
        fields["priority"] = int_field(row, "priority")
    lora = _lora_field(row)
    if lora is not None:
        fields["lora"] = lora
    if _given(row, "prefix_group"):
        if not _given(row, "prefix_tokens"):
            raise ValueError("prefix_group needs prefix_tokens (how many prompt tokens the group shares).")
        prefix_tokens = int_field(row, "prefix_tokens")
        if not 1 <= prefix_tokens <= fields["input_tokens"]:
            raise ValueError(f"prefix_tokens must be in [1, input_tokens], got {prefix_tokens}.")
        fields["prefix_blocks"] = (group_block_id(str(row["prefix_group"])),)
        fields["prefix_block_tokens"] = prefix_tokens
    elif _given(row, "prefix_tokens"):
        raise ValueError("prefix_tokens given without prefix_group.")
    return arrival, fields


def _lora_field(row: dict) -> str | None:
    given = [key for key in LORA_COLUMNS if _given(row, key)]
    if len(given) > 1:
        raise ValueError("give the adapter in one column, lora or adapter, not both.")
    return str(row[given[0]]).strip() if given else None


def group_block_id(group: str) -> int:
    """The prefix block id of a named shared prefix, stable across runs."""
    return stable_seed(f"prefix-group:{group}") & MAX_BLOCK_ID


def _given(row: dict, key: str) -> bool:
    value = row.get(key)
    return value is not None and not (isinstance(value, str) and not value.strip())


def int_field(row: dict, key: str) -> int:
    """``row[key]`` as an int, from an int or its decimal text."""
    value = row[key]
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{key} must be an integer, got {value!r}.") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}.")
    return value


def float_field(row: dict, key: str) -> float:
    """``row[key]`` as a finite float, from a number or its text."""
    value = row[key]
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a number, got {value!r}.") from None
    if not math.isfinite(number):
        raise ValueError(f"{key} must be finite, got {value!r}.")
    return number
