"""CORS for ``twinserve serve`` (vLLM's flags): ``--allowed-origins``, ``--allowed-methods``,
``--allowed-headers``, ``--allow-credentials``, served by Starlette's ``CORSMiddleware``.

Unlike vLLM (whose default allows every origin), no origin is allowed unless named: a server
on loopback must not let any web page a user visits read its answers. Lists are JSON
(``'["https://a.example"]'``, vLLM's form) or comma-separated.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

DEFAULT_METHODS = ("GET", "POST", "OPTIONS")


@dataclass(frozen=True, slots=True)
class CORSOptions:
    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = DEFAULT_METHODS
    headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if self.allow_credentials and "*" in self.origins:
            raise ValueError("--allow-credentials cannot be combined with --allowed-origins '*' "
                             "(browsers refuse credentials for a wildcard origin): name the "
                             "origins.")


def parse_list(value: str, flag: str) -> tuple[str, ...]:
    """A JSON list of strings, or comma-separated names."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{flag}: not a JSON list: {exc}") from None
        if not isinstance(items, list) or any(not isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(f"{flag}: must be a JSON list of strings.")
        return tuple(i.strip() for i in items if i.strip())
    return tuple(i.strip() for i in text.split(",") if i.strip())


def add_cors_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--allowed-origins", type=lambda v: parse_list(v, "--allowed-origins"),
                       default=(), metavar="ORIGINS",
                       help="origins that browsers may call the API from (CORS), as a JSON "
                            "list or comma-separated; '*' for any (default: none)")
    group.add_argument("--allowed-methods", type=lambda v: parse_list(v, "--allowed-methods"),
                       default=DEFAULT_METHODS, metavar="METHODS",
                       help="HTTP methods allowed cross-origin (default: GET, POST, OPTIONS)")
    group.add_argument("--allowed-headers", type=lambda v: parse_list(v, "--allowed-headers"),
                       default=("*",), metavar="HEADERS",
                       help="request headers allowed cross-origin (default: any)")
    group.add_argument("--allow-credentials", action="store_true",
                       help="allow credentials (cookies, Authorization) cross-origin")


def cors_options(args: argparse.Namespace) -> CORSOptions:
    return CORSOptions(tuple(getattr(args, "allowed_origins", ()) or ()),
                       tuple(getattr(args, "allowed_methods", DEFAULT_METHODS) or ()),
                       tuple(getattr(args, "allowed_headers", ("*",)) or ()),
                       bool(getattr(args, "allow_credentials", False)))


def install_cors(app: FastAPI, options: CORSOptions) -> None:
    """Adds the middleware only when an origin is allowed (otherwise browsers' same-origin
    rule stands and preflights are answered as any unknown OPTIONS request)."""
    if options.origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.origins),
                           allow_methods=list(options.methods),
                           allow_headers=list(options.headers),
                           allow_credentials=options.allow_credentials)


def add_model_tag_arg(parser: argparse.ArgumentParser) -> None:
    """``twinserve serve MODEL``, as ``vllm serve MODEL`` (``--model`` still works)."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve (same as --model)")


def resolve_model_tag(args: argparse.Namespace) -> None:
    """Folds the positional model into ``args.model``; both given and different: an error."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    model = getattr(args, "model", None)
    if model is not None and model != tag:
        raise ValueError(f"the model is given twice: {tag!r} (positional) and --model "
                         f"{model!r}; give it once.")
    args.model = tag
