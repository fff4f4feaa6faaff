"""Tool calling on ``/v1/chat/completions``, as vLLM does it: the request's ``tools`` and
``tool_choice`` checked, the grammar that enforces a forced choice, and the parser that reads
the output.

- ``none``: no calls are parsed (the tools are still shown to the template, as vLLM does);
- ``auto`` (the default when tools are given): the server's ``--tool-call-parser`` reads calls
  from free text; without ``--enable-auto-tool-choice`` it is refused, as vLLM refuses it;
- ``required`` and a named function: constrained decoding forces the output (a JSON array of
  ``{"name", "parameters"}`` objects, or the named function's arguments object), so the
  arguments always match the tools' parameter schemas.

A tool is ``{"type": "function", "function": {"name", "description", "parameters",
"strict"}}``; a bad one is a ValueError whose message starts with its path
(``tools[1].function.parameters ...``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from twinserve.core.structured_outputs import StructuredOutputsParams
from twinserve.entrypoints.tool_parsers.base import ParsedCall, ToolParser
from twinserve.entrypoints.tool_parsers.forced import NamedToolParser, RequiredToolParser

MAX_TOOLS = 128  # OpenAI's limit
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
# Omitted parameters: a function that takes no arguments (so a forced call is "{}").
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                    "additionalProperties": False}
ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    definition: dict[str, Any]  # {"type": "function", "function": {...}}, for the template


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools and how their calls are produced and read."""

    tools: tuple[Tool, ...] = ()
    mode: ToolMode = "none"
    function: str | None = None  # the named function
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.definition for t in self.tools] or None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar a forced choice decodes under (None: free text)."""
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))
        if self.mode == "named":
            tool = next(t for t in self.tools if t.name == self.function)
            return StructuredOutputsParams(json=tool.parameters)
        return None

    def parser(self, auto_parser: type[ToolParser] | None) -> ToolParser | None:
        """The parser for one choice's output (None: plain content)."""
        if self.mode == "required":
            return RequiredToolParser()
        if self.mode == "named":
            assert self.function is not None
            return NamedToolParser(self.function)
        if self.mode == "auto" and auto_parser is not None:
            return auto_parser()
        return None

    def kept(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        """``parallel_tool_calls=false`` keeps the first call only."""
        return calls if self.parallel else calls[:1]


def required_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """vLLM's grammar for ``tool_choice="required"``: an array of calls of the given tools."""
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object",
         "properties": {"name": {"type": "string", "enum": [t.name]},
                        "parameters": t.parameters},
         "required": ["name", "parameters"], "additionalProperties": False}
        for t in tools]}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_tools(value: Any) -> tuple[Tool, ...]:
    """The request's ``tools``, checked (names unique, parameters a JSON schema object)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError("tools must be a list of tools.")
    if len(value) > MAX_TOOLS:
        raise ValueError(f"tools may hold at most {MAX_TOOLS} tools, got {len(value)}.")
    tools: list[Tool] = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        tool = _tool(f"tools[{i}]", item)
        if tool.name in seen:
            raise ValueError(f"tools[{i}].function.name {tool.name!r} is given twice; tool "
                             "names must be unique.")
        seen.add(tool.name)
        tools.append(tool)
    return tuple(tools)


def _tool(where: str, item: Any) -> Tool:
    if not isinstance(item, Mapping):
        raise ValueError(f"{where} must be an object {{\"type\": \"function\", \"function\": "
                         "{...}}.")
    kind = item.get("type")
    if kind != "function":
        raise ValueError(f"{where}.type must be \"function\" (twinserve implements function "
                         f"tools only), got {kind!r}.")
    function = item.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"{where}.function must be an object with a name.")
    unknown = sorted(set(function) - FUNCTION_KEYS)
    if unknown:
        raise ValueError(f"{where}.function has unknown field(s) {unknown}; a function has "
                         f"{sorted(FUNCTION_KEYS)}.")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', "
                         f"got {name!r}.")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string.")
    parameters = function.get("parameters", EMPTY_PARAMETERS)
    _check_parameters(f"{where}.function.parameters", parameters)
    definition = {"type": "function", "function": {**function, "parameters": parameters}}
    return Tool(name, dict(parameters), definition)


def _check_parameters(where: str, schema: Any) -> None:
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where} must be a JSON schema object, got {type(schema).__name__}.")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where} must describe an object (\"type\": \"object\"), got "
                         f"type {schema.get('type')!r}.")
    from twinserve.gpu.worker.structured_outputs import compile_grammar
    try:
        compile_grammar(StructuredOutputsParams(json=dict(schema)))
    except ValueError as exc:
        detail = str(exc).removeprefix("structured_outputs.json is invalid: ")
        raise ValueError(f"{where} is not a JSON schema twinserve can enforce: {detail}") \
            from None


def tool_request(tools_value: Any, tool_choice: Any, parallel_tool_calls: bool | None,
                 auto_enabled: bool) -> ToolRequest:
    """The request's tool calling; ValueError starting with ``tools`` or ``tool_choice``.
    ``auto_enabled``: the server runs with ``--enable-auto-tool-choice`` and a parser."""
    tools = parse_tools(tools_value)
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, Mapping):
        return ToolRequest(tools, "named", _named(tool_choice, tools), parallel)
    if tool_choice not in ("none", "auto", "required"):
        raise ValueError("tool_choice must be \"none\", \"auto\", \"required\" or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                         f"{tool_choice!r}.")
    if tool_choice != "none" and not tools:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools: when using tool_choice, "
                         "tools must be set.")
    if tool_choice == "auto" and not auto_enabled:
        raise ValueError("tool_choice \"auto\" requires --enable-auto-tool-choice and "
                         "--tool-call-parser to be set (the default when tools are given).")
    return ToolRequest(tools, tool_choice, None, parallel)


def _named(choice: Mapping[str, Any], tools: tuple[Tool, ...]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError("tool_choice must name a function as {\"type\": \"function\", "
                         "\"function\": {\"name\": ...}}.")
    if not any(t.name == name for t in tools):
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools.")
    return name


def check_history(messages: Sequence[Mapping[str, Any]]) -> None:
    """Past tool calls in the conversation: an assistant's ``tool_calls`` are
    ``{"id", "type": "function", "function": {"name", "arguments": "<JSON text>"}}``; a
    ``tool`` message answers one (``tool_call_id``)."""
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls and message.get("role") != "assistant":
            raise ValueError(f"messages[{i}].tool_calls: only assistant messages make tool "
                             "calls.")
        for j, call in enumerate(calls or []):
            where = f"messages[{i}].tool_calls[{j}]"
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise ValueError(f"{where} must be {{\"id\": ..., \"type\": \"function\", "
                                 "\"function\": {\"name\": ..., \"arguments\": ...}}.")
            if not isinstance(function.get("arguments", ""), str):
                raise ValueError(f"{where}.function.arguments must be a string (JSON text).")
        if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise ValueError(f"messages[{i}].tool_call_id: a tool message needs the id of the "
                             "call it answers.")
