"""Reading request traces: the bundled public traces by name, or a file in one of three formats.

Formats, told apart by the file's columns (CSV header or the first JSONL object's keys):

- Azure LLM inference 2023 CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens``, timestamps like
  ``2023-11-16 18:15:46.6805900``.
- Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, optional ``hash_ids``
  (one id per 512-token prompt block; kept as prefix blocks of 512 tokens, see ``TraceRequest``).
- twinserve's plain format, CSV or JSONL (see ``plain_format``): ``arrival_time_s, input_tokens,
  output_tokens[, tenant, priority, prefix_group, prefix_tokens, lora]``.

Every loader returns requests sorted by arrival (stable: ties keep file order) and re-based so that the
first arrives at 0.0. Request ids are ``<trace>-<row>``, the row counted from 0 in file order. Blank lines
are ignored; any other bad row raises ``TraceError`` naming the file and its 1-based line number.

``load_trace(name, limit=n)`` is ``load_trace(name)[:n]``. A bundled trace is stored sorted by arrival
(``tests/traces/test_traces.py`` checks every row), so its first ``n`` rows are its first ``n`` requests and
only they are read; any other file is read, checked and sorted whole first.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

from twinserve.traces.bundled import BUNDLED_TRACES
from twinserve.traces.errors import TraceError
from twinserve.traces.plain_format import Parsed, RowParser, int_field, parse_plain_row
from twinserve.traces.trace_request import TraceRequest

if TYPE_CHECKING:
    import _csv

MOONCAKE_BLOCK_TOKENS = 512
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")


def load_trace(name_or_path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Loads a bundled trace (``azure-conv``, ``azure-code``, ``mooncake``) or a trace file; with
    ``limit`` (>= 1), only its first ``limit`` requests in arrival order."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an integer >= 1, got {limit!r}.")
    key = str(name_or_path)
    if key in BUNDLED_TRACES:  # sorted by arrival: the first rows are the first requests
        return _load_file(BUNDLED_TRACES[key], key, limit, limit)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown trace {key!r}: give one of {', '.join(BUNDLED_TRACES)} "
                         f"or the path of a .csv or .jsonl file.")
    return _load_file(path, path.stem, None, limit)


def _load_file(path: Path, trace_name: str, max_rows: int | None,
               limit: int | None) -> list[TraceRequest]:
    """The file's requests (its first ``max_rows`` rows where given), the first ``limit`` kept."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        rows = _csv_rows(path)
    elif suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(path)
    else:
        raise TraceError(f"{path}: unknown trace format {suffix!r}, expected .csv or .jsonl.")
    parsed = list(rows if max_rows is None else itertools.islice(rows, max_rows))
    if not parsed:
        raise TraceError(f"{path}: no requests.")
    requests = _build(path, trace_name, parsed)
    return requests if limit is None else requests[:limit]


def _build(path: Path, trace_name: str, parsed: list[tuple[int, Parsed]]) -> list[TraceRequest]:
    t0 = min(arrival for _, (arrival, _) in parsed)
    requests = []
    for index, (line, (arrival, fields)) in enumerate(parsed):
        try:
            requests.append(TraceRequest(request_id=f"{trace_name}-{index}",
                                         arrival_time=arrival - t0, **fields))
        except ValueError as exc:
            raise TraceError(f"{path}:{line}: {exc}") from None
    requests.sort(key=lambda r: r.arrival_time)  # stable: ties keep file order
    return requests


def _csv_rows(path: Path) -> Iterator[tuple[int, Parsed]]:
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{path}:1: empty file, expected a CSV header.")
        header = [h.strip() for h in header]
        if all(c in header for c in AZURE_COLUMNS):
            yield from _azure_csv_rows(path, reader, header)
            return
        parse = _csv_parser(path, header)
        for fields in reader:
            if not fields or (len(fields) == 1 and not fields[0].strip()):  # blank line
                continue
            line = reader.line_num
            if len(fields) != len(header):
                raise TraceError(f"{path}:{line}: expected {len(header)} fields, got {len(fields)}.")
            yield line, _guarded(path, line, parse, dict(zip(header, fields)))


def _azure_csv_rows(path: Path, reader: _csv.Reader,
                    header: list[str]) -> Iterator[tuple[int, Parsed]]:
    """``_csv_rows`` for an Azure header: the common row (three columns that parse) read by
    position; any other row goes through the general path, which yields or raises as before."""
    date_cache: dict[str, tuple[int, float]] = {}
    parse = _azure_row(date_cache)
    width = len(header)
    column = {name: i for i, name in enumerate(header)}  # the last of repeated names, as dict(zip())
    at_ts, at_in, at_out = (column[c] for c in AZURE_COLUMNS)
    for fields in reader:
        if len(fields) == width:
            try:
                # int() of the cell's text, as int_field; _azure_seconds as the row parser calls it
                parsed = (_azure_seconds(fields[at_ts], date_cache),
                          {"input_tokens": int(fields[at_in]), "output_tokens": int(fields[at_out])})
            except ValueError:
                pass
            else:
                yield reader.line_num, parsed
                continue
        if not fields or (len(fields) == 1 and not fields[0].strip()):  # blank line
            continue
        line = reader.line_num
        if len(fields) != width:
            raise TraceError(f"{path}:{line}: expected {width} fields, got {len(fields)}.")
        yield line, _guarded(path, line, parse, dict(zip(header, fields)))


def _csv_parser(path: Path, header: list[str]) -> RowParser:
    """The row parser of a CSV that is not Azure's (``_azure_csv_rows`` reads those)."""
    if "arrival_time_s" in header or "input_tokens" in header:
        return parse_plain_row
    raise TraceError(f"{path}:1: unknown CSV header {header}; expected {list(AZURE_COLUMNS)} or "
                     f"arrival_time_s,input_tokens,output_tokens[,tenant,priority,prefix_group,"
                     f"prefix_tokens,lora].")


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Parsed]]:
    parse: RowParser | None = None
    with path.open() as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{line}: bad JSON ({exc.msg}).") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{path}:{line}: expected a JSON object, got {type(obj).__name__}.")
            if parse is None:
                mooncake = any(key in obj for key in (*MOONCAKE_KEYS, "hash_ids"))
                parse = _mooncake_row if mooncake else parse_plain_row
            yield line, _guarded(path, line, parse, obj)


def _guarded(path: Path, line: int, parse: RowParser, row: dict) -> Parsed:
    """Runs a row parser; any complaint becomes a ``TraceError`` at this file and line."""
    try:
        return parse(row)
    except KeyError as exc:
        raise TraceError(f"{path}:{line}: missing column {exc.args[0]!r}.") from None
    except (ValueError, TypeError) as exc:
        raise TraceError(f"{path}:{line}: {exc}") from None


def _azure_row(date_cache: dict[str, tuple[int, float]]) -> RowParser:
    def parse(row: dict) -> Parsed:
        fields = {"input_tokens": int_field(row, "ContextTokens"),
                  "output_tokens": int_field(row, "GeneratedTokens")}
        return _azure_seconds(row["TIMESTAMP"], date_cache), fields
    return parse


def _azure_seconds(text: str, date_cache: dict[str, tuple[int, float]]) -> float:
    """``YYYY-MM-DD HH:MM:SS.fffffff`` -> seconds since midnight of the first day seen (naive)."""
    try:
        day, clock = text.strip().split(" ")
        if day not in date_cache:  # seconds from the first day seen: small floats keep the precision
            ordinal = date.fromisoformat(day).toordinal()
            first = next(iter(date_cache.values()), (ordinal, 0.0))[0]
            date_cache[day] = (first, (ordinal - first) * 86400.0)
        hours, minutes, seconds = clock.split(":")
        h, m, s = int(hours), int(minutes), float(seconds)
        if not (0 <= h < 24 and 0 <= m < 60 and 0 <= s < 61):
            raise ValueError
    except ValueError:
        raise ValueError(f"unparsable timestamp {text!r}, expected YYYY-MM-DD HH:MM:SS.fffffff.") from None
    return date_cache[day][1] + h * 3600 + m * 60 + s


def _mooncake_row(row: dict) -> Parsed:
    for key in MOONCAKE_KEYS:
        if key not in row:
            raise KeyError(key)
    timestamp = row["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) \
            or not math.isfinite(timestamp):
        raise ValueError(f"timestamp must be a number of milliseconds, got {timestamp!r}.")
    hash_ids = row.get("hash_ids", [])
    if not isinstance(hash_ids, list):
        raise ValueError(f"hash_ids must be a list, got {hash_ids!r}.")
    fields = {"input_tokens": int_field(row, "input_length"),
              "output_tokens": int_field(row, "output_length"),
              "prefix_blocks": tuple(hash_ids), "prefix_block_tokens": MOONCAKE_BLOCK_TOKENS}
    return timestamp / 1000.0, fields

