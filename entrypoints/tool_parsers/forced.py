"""The outputs of a forced tool choice, which constrained decoding shapes (vLLM's formats):

- ``tool_choice="required"``: a JSON array of ``{"name": ..., "parameters": {...}}`` objects
  (``RequiredToolParser``; ``chat_tools.required_schema`` is its grammar);
- a named function: the arguments object alone (``NamedToolParser``; the grammar is the
  function's parameter schema), the name coming from the request.
"""

from __future__ import annotations

from typing import ClassVar

from twinserve.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    finished_call,
    partial_call,
)
from twinserve.entrypoints.tool_parsers.json_scan import scan_object, skip_ws


def _array_items(text: str) -> tuple[list[tuple[int, int | None]], bool]:
    """The ``(start, end)`` of each object of the array ``text`` holds (end None while
    incomplete), and whether the array is closed with nothing after it."""
    i = skip_ws(text, 0)
    if i == len(text) or text[i] != "[":
        return [], False
    items: list[tuple[int, int | None]] = []
    i = skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "]" and items:
            return items, skip_ws(text, i + 1) == len(text)
        end = scan_object(text, i).end
        items.append((i, end))
        if end is None:
            break
        i = skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i = skip_ws(text, i + 1)
        elif i < len(text) and text[i] != "]":
            break
    return items, False


class RequiredToolParser(ToolParser):
    name: ClassVar[str] = "required"

    def parse_partial(self, text: str) -> ParsedOutput:
        calls = []
        for start, _ in _array_items(text)[0]:
            call = partial_call(text, scan_object(text, start))
            if call is None:
                break
            calls.append(call)
        return ParsedOutput("", calls)

    def parse_final(self, text: str) -> ParsedOutput:
        items, closed = _array_items(text)
        calls: list[ParsedCall] = []
        for start, end in items:
            body = text[start:end] if end is not None else ""
            call = finished_call(body, scan_object(body))
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
        return ParsedOutput("", calls) if closed and calls else ParsedOutput(text)


class NamedToolParser(ToolParser):
    """The call is always reported, even when a length limit cut its arguments short (the
    finish reason says so), as vLLM does."""

    name: ClassVar[str] = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse_partial(self, text: str) -> ParsedOutput:
        return ParsedOutput("", [ParsedCall(self.function_name, text)])

    def parse_final(self, text: str) -> ParsedOutput:
        return ParsedOutput("", [ParsedCall(self.function_name, text, complete=True)])
