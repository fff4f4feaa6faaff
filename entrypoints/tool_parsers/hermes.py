"""``hermes``: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
(Hermes 2/3, Qwen2.5 and the ChatML models prompted the same way), as vLLM's ``hermes`` parser.

The content is the text before the first ``<tool_call>``; every block must hold one valid call
(the last may lack its ``</tool_call>`` when the output ended right after the object), else the
output is plain content.
"""

from __future__ import annotations

from typing import ClassVar

from twinserve.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    finished_call,
    held_back,
    partial_call,
)
from twinserve.entrypoints.tool_parsers.json_scan import scan_object

START, END = "<tool_call>", "</tool_call>"


def _blocks(text: str, first: int) -> list[tuple[str, bool]]:
    """``(body, closed)`` of each block from the ``<tool_call>`` at ``first``."""
    blocks = []
    pos = first
    while pos >= 0:
        body_start = pos + len(START)
        end = text.find(END, body_start)
        if end < 0:
            blocks.append((text[body_start:], False))
            break
        blocks.append((text[body_start:end], True))
        pos = text.find(START, end + len(END))
    return blocks


class HermesToolParser(ToolParser):
    name: ClassVar[str] = "hermes"

    def parse_partial(self, text: str) -> ParsedOutput:
        first = text.find(START)
        if first < 0:
            return ParsedOutput(text[:len(text) - held_back(text, START)])
        calls = []
        for body, _ in _blocks(text, first):
            call = partial_call(body, scan_object(body))
            if call is None:
                break
            calls.append(call)
        return ParsedOutput(text[:first], calls)

    def parse_final(self, text: str) -> ParsedOutput:
        first = text.find(START)
        if first < 0:
            return ParsedOutput(text)
        calls: list[ParsedCall] = []
        for body, _closed in _blocks(text, first):
            stripped = body.strip()
            call = finished_call(stripped, scan_object(stripped))
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
        return ParsedOutput(text[:first], calls)
