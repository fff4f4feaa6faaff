"""``llama3_json``: Llama 3.1/3.2's JSON tool calls, as vLLM's ``llama3_json`` parser: the whole
output is ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), optionally after
``<|python_tag|>``, several calls separated by ``;``. An output that does not start with one
(after whitespace) is plain content, and so is one whose calls do not all parse.
"""

from __future__ import annotations

import json
from typing import ClassVar

from twinserve.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    finished_call,
    partial_call,
)
from twinserve.entrypoints.tool_parsers.json_scan import scan_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


def _calls_start(text: str) -> int | None:
    """Where the first call's ``{`` is; -1 while undecided (blank, or a prefix of the tag);
    None when the output is plain content."""
    i = skip_ws(text, 0)
    if i == len(text) or (PYTHON_TAG.startswith(text[i:]) and len(text) - i < len(PYTHON_TAG)):
        return -1
    if text.startswith(PYTHON_TAG, i):
        i = skip_ws(text, i + len(PYTHON_TAG))
        if i == len(text):
            return -1
    return i if text[i] == "{" else None


def _next_call(text: str, end: int) -> int | None:
    """After a call ending at ``end``: where the next one starts, len(text) at the end, None
    when something else follows."""
    i = skip_ws(text, end)
    if i < len(text) and text[i] == ";":
        i = skip_ws(text, i + 1)
    if i == len(text) or text[i] == "{":
        return i
    return None


class Llama3JsonToolParser(ToolParser):
    name: ClassVar[str] = "llama3_json"

    def parse_partial(self, text: str) -> ParsedOutput:
        start = _calls_start(text)
        if start is None:
            return ParsedOutput(text)
        calls = []
        pos: int | None = start
        while pos is not None and 0 <= pos < len(text):
            scan = scan_object(text, pos)
            call = partial_call(text, scan)
            if call is None:
                break
            calls.append(call)
            pos = _next_call(text, scan.end) if scan.end is not None else None
        return ParsedOutput("", calls)

    def parse_final(self, text: str) -> ParsedOutput:
        start = _calls_start(text)
        if start is None or start < 0:
            return ParsedOutput(text)
        calls: list[ParsedCall] = []
        pos: int | None = start
        while pos is not None and pos < len(text):
            scan = scan_object(text, pos)
            if scan.end is None:
                return ParsedOutput(text)
            call = finished_call(text[pos:scan.end], scan_object(text[pos:scan.end]))
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
            pos = _next_call(text, scan.end)
        return ParsedOutput("", calls) if pos is not None else ParsedOutput(text)

    def format_instructions(self, tools_json: list[str]) -> str:
        """Llama 3.1's JSON-based tool-calling prompt."""
        return ("Given the following functions, please respond with a JSON for a function "
                "call with its proper arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of '
                "argument name and its value}. Do not use variables.\n\n"
                + "\n\n".join(tools_json))

    def format_call(self, name: str, arguments: object) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
