"""The server's chat flags, vLLM's names: ``--chat-template``, ``--trust-request-chat-template``,
``--enable-auto-tool-choice`` and ``--tool-call-parser``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinserve.entrypoints.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser

TEMPLATE_CHARS = frozenset("{}\n")


@dataclass(frozen=True, slots=True)
class ChatServerOptions:
    """``chat_template``: the server's template (None: the model's own)."""

    chat_template: str | None = None
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False
    tool_parser: type[ToolParser] | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(sorted(TOOL_PARSERS))}).")

    @property
    def auto_tools(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_parser is not None

    def tool_format(self) -> ToolParser | None:
        """The format tools are described in to a template that has no tools section."""
        return self.tool_parser() if self.tool_parser is not None else None


def load_chat_template(value: str | None) -> str | None:
    """vLLM's rule: a file's contents if ``value`` names one, else ``value`` itself when it
    looks like a template (it holds ``{``, ``}`` or a newline), else an error."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a name too long for a path: an inline template
        pass
    if TEMPLATE_CHARS & set(value):
        return value
    raise ValueError(f"--chat-template {value!r} looks like a file path, but there is no such "
                     "file (an inline template holds '{' or a newline).")


def add_chat_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="the chat template (a jinja2 file, or the template itself) used "
                            "instead of the model's")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat_template in requests (rendered in jinja2's "
                            "sandbox); refused without it, as vLLM refuses it")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="parse tool calls from the output for tool_choice \"auto\" "
                            "(needs --tool-call-parser)")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how tool calls are read from the output: hermes "
                            "(<tool_call> blocks; the bundled ChatML model) or llama3_json")


def chat_server_options(args: argparse.Namespace) -> ChatServerOptions:
    """The options ``args`` hold (missing attributes take their defaults); ValueError naming
    the flag for a bad value."""
    parser = getattr(args, "tool_call_parser", None)
    return ChatServerOptions(
        chat_template=load_chat_template(getattr(args, "chat_template", None)),
        trust_request_chat_template=bool(getattr(args, "trust_request_chat_template", False)),
        enable_auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)),
        tool_parser=get_tool_parser(parser) if parser else None)


def checked_chat_options(args: argparse.Namespace, tokenizer: Any) -> ChatServerOptions:
    """``chat_server_options(args)``, with ``--chat-template`` compiled for the model's
    tokenizer (a template that does not compile stops the server before it serves)."""
    options = chat_server_options(args)
    if options.chat_template is not None:
        if tokenizer is None:
            raise ValueError("--chat-template: this model has no tokenizer.")
        tokenizer.template(options.chat_template)
    return options
