"""What a tool-call parser returns, and the parser interface.

A parser reads a model's output text two ways: ``parse_partial`` while it streams (the content
that is safe to send so far, and the calls begun so far, their ``arguments`` as the raw JSON text
that has arrived) and ``parse_final`` once it is complete (every call finished and valid, or,
when the tool-call part is malformed, no calls and the whole text as content). The arguments of
a call are the raw span of its JSON object in the output in both, so streamed fragments
concatenate to exactly the non-streamed arguments.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from twinserve.entrypoints.tool_parsers.json_scan import ObjectScan, skip_ws

NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(slots=True)
class ParsedCall:
    """``name`` None until its string has arrived; ``arguments`` the JSON text so far."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass(slots=True)
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(ABC):
    """Extracts tool calls from one model's output format (one instance per choice)."""

    name: ClassVar[str]

    @abstractmethod
    def parse_partial(self, text: str) -> ParsedOutput:
        """While streaming: content safe to send (a prefix of the final content) and the calls
        begun; each call's arguments a prefix of its final arguments."""

    @abstractmethod
    def parse_final(self, text: str) -> ParsedOutput:
        """The finished output: complete, valid calls, or none and ``text`` as content."""

    def format_instructions(self, tools_json: list[str]) -> str:
        """The system prompt that describes the tools and this format, for chat templates
        with no tools section of their own (see ``entrypoints/chat_template.py``)."""
        return hermes_instructions(tools_json)

    def format_call(self, name: str, arguments: object) -> str:
        """A past call, written the way this format reads it (for the same templates)."""
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"


def hermes_instructions(tools_json: list[str]) -> str:
    """Hermes' (and Qwen2.5's) tool prompt, as their chat templates render it."""
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            "<tools>\n" + "\n".join(tools_json) + "\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def partial_call(text: str, scan: ObjectScan) -> ParsedCall | None:
    """The call an object (``{"name": ..., "arguments": {...}}``) being streamed describes so
    far; None before anything of it is known. Arguments count only once they open an object."""
    if scan.error:
        return None
    name_member = scan.member(*NAME_KEYS)
    name = None
    if name_member is not None and name_member.value_end is not None:
        value = _loads(name_member.value_text(text))
        name = value if isinstance(value, str) else None
    args = scan.member(*ARGUMENT_KEYS)
    arguments = args.value_text(text) if args is not None else ""
    if not arguments.startswith("{"):
        arguments = ""
    if name is None and not arguments:
        return None
    return ParsedCall(name, arguments, complete=scan.end is not None)


def finished_call(text: str, scan: ObjectScan) -> ParsedCall | None:
    """The call the complete object ``text`` (scanned) holds, if it is valid: one string
    ``name``, one object ``arguments`` (or ``parameters``), nothing else after it."""
    if scan.error or scan.end is None or skip_ws(text, scan.end) != len(text):
        return None
    value = _loads(text)
    keys = [m.key for m in scan.members]
    if not isinstance(value, dict) or len(set(keys)) != len(keys):
        return None
    name = value.get("name")
    arg_keys = [k for k in ARGUMENT_KEYS if k in value]
    if not isinstance(name, str) or len(arg_keys) != 1 or \
            not isinstance(value[arg_keys[0]], dict):
        return None
    member = scan.member(arg_keys[0])
    assert member is not None
    return ParsedCall(name, member.value_text(text), complete=True)


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None
