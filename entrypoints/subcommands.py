"""Subcommands whose flags live beside their implementation (serve, bench, sweep, ...)."""

from __future__ import annotations

PARSERS: list = []
