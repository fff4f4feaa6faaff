"""The one error a malformed trace raises."""

from __future__ import annotations


class TraceError(ValueError):
    """A trace file that cannot be read; the message starts with ``<file>:<1-based line>:``."""
