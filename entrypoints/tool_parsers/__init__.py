"""Tool-call parsers, chosen by name with ``twinserve serve --tool-call-parser NAME``.

``TOOL_PARSERS`` maps each name to its class (one file per format); ``get_tool_parser`` checks
a name. The forced formats (``tool_choice="required"`` or a named function, which constrained
decoding produces) live in ``forced.py`` and are not chosen by flag.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from twinserve.entrypoints.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser
from twinserve.entrypoints.tool_parsers.hermes import HermesToolParser
from twinserve.entrypoints.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: Mapping[str, type[ToolParser]] = MappingProxyType({
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
})


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; ValueError listing the known ones."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"--tool-call-parser {name!r} is not a tool-call parser twinserve "
                         f"knows; choose one of {', '.join(sorted(TOOL_PARSERS))}.") from None


__all__ = ["TOOL_PARSERS", "ParsedCall", "ParsedOutput", "ToolParser", "get_tool_parser"]
