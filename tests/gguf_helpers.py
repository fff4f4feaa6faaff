"""Helpers for tests that write GGUF files."""

from __future__ import annotations


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 byte-level BPE base tokens."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars
