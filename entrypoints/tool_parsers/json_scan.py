"""Where the parts of a JSON object lie in text that may still be arriving.

A tool-call parser needs the raw text of a call's ``arguments`` as it streams, so that the
fragments it sends concatenate to exactly the arguments of the finished call (the non-streamed
answer uses the same span). ``scan_object`` walks one object from ``start`` and reports each
member's key (once its string is closed) and the span of its value (open-ended while the value
is incomplete); it does not build values (``json.loads`` of the finished span checks them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"
_CLOSERS = {"{": "}", "[": "]"}
_STRUCTURAL = re.compile(r'["{}\[\]]')


@dataclass(slots=True)
class Member:
    """One ``"key": value`` of an object; ``value_end`` None while the value is incomplete."""

    key: str | None
    value_start: int | None = None
    value_end: int | None = None

    def value_text(self, text: str) -> str:
        if self.value_start is None:
            return ""
        return text[self.value_start:self.value_end if self.value_end is not None
                    else len(text)]


@dataclass(slots=True)
class ObjectScan:
    """``end``: the index after the closing brace (None: not closed yet); ``error``: the text
    cannot be the start of a JSON object."""

    members: list[Member] = field(default_factory=list)
    end: int | None = None
    error: bool = False

    def member(self, *keys: str) -> Member | None:
        """The first member named one of ``keys``."""
        return next((m for m in self.members if m.key in keys), None)


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def scan_string(text: str, i: int) -> int | None:
    """``text[i] == '"'``: the index after the closing quote, None if it has not arrived.
    Jumps quote to quote with ``str.find`` (a quote after an odd run of backslashes is
    escaped); ``scan_string_plain`` is the character-by-character reference."""
    start = i + 1
    q = text.find('"', start)
    while q >= 0:
        b = q
        while b > start and text[b - 1] == "\\":
            b -= 1
        if (q - b) % 2 == 0:
            return q + 1
        q = text.find('"', q + 1)
    return None


def scan_string_plain(text: str, i: int) -> int | None:
    i += 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == '"':
            return i + 1
        i += 1
    return None


def scan_value(text: str, i: int) -> int | None:
    """The index after the JSON value starting at ``text[i]``, None if it is incomplete.
    Containers are matched bracket for bracket (strings skipped, the text between them
    jumped over with a regex); a scalar ends at the first delimiter (whitespace, ``,``, ``}``,
    ``]``), so one at the end of ``text`` is incomplete."""
    ch = text[i]
    if ch == '"':
        return scan_string(text, i)
    if ch in _CLOSERS:
        depth = 0
        while True:
            found = _STRUCTURAL.search(text, i)
            if found is None:
                return None
            i = found.start()
            ch = text[i]
            if ch == '"':
                end = scan_string(text, i)
                if end is None:
                    return None
                i = end
                continue
            depth += 1 if ch in "{[" else -1
            i += 1
            if depth == 0:
                return i
    while i < len(text) and text[i] not in WHITESPACE + ",}]":
        i += 1
    return i if i < len(text) else None


def _key(raw: str) -> str | None:
    try:
        key = json.loads(raw)
    except ValueError:
        return None
    return key if isinstance(key, str) else None


def scan_object(text: str, start: int = 0) -> ObjectScan:
    """The members of the JSON object whose ``{`` is the first non-blank at ``start``."""
    scan = ObjectScan()
    i = skip_ws(text, start)
    if i >= len(text):
        return scan
    if text[i] != "{":
        scan.error = True
        return scan
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return scan
        if text[i] == "}" and not scan.members:
            scan.end = i + 1
            return scan
        if text[i] != '"':
            scan.error = True
            return scan
        key_end = scan_string(text, i)
        if key_end is None:
            return scan
        member = Member(_key(text[i:key_end]))
        if member.key is None:
            scan.error = True
            return scan
        scan.members.append(member)
        i = skip_ws(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            scan.error = True
            return scan
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        member.value_start = i
        end = scan_value(text, i)
        if end is None:
            return scan
        member.value_end = end
        i = skip_ws(text, end)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            scan.error = True
            return scan
        i += 1
