"""Disaggregated prefill/decode routing (xPyD), shared by the twin's P/D fleet and the real front.

A request first runs on a prefill instance as a one-token request marked ``do_remote_decode``;
its finishing output's ``kv_transfer_params`` then go, with the original request, to a decode
instance, which loads the prompt's KV and samples the first token itself (the prefill instance's
token is discarded, as vLLM's proxy does). Each pool has its own router over its own replicas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.routers import make_router
from twinserve.routers.router import ReplicaLoad, Router

PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {"do_remote_decode": True}


def prefill_sampling_params(params: SamplingParams) -> SamplingParams:
    """The prefill instance's copy of a request's sampling parameters: one token, one sample."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=0, n=1)


def prefill_kv_transfer_params() -> dict[str, Any]:
    """A fresh ``{"do_remote_decode": True}`` (the scheduler replaces a request's params)."""
    return dict(PREFILL_KV_TRANSFER_PARAMS)


class DisaggregatedRouter:
    """A prefill router over the prefill pool and a decode router over the decode pool; each
    sees only its own pool's loads (``ReplicaLoad``s, refreshed by the caller)."""

    __slots__ = ("prefill", "decode", "num_prefill", "num_decode")

    def __init__(self, prefill: Router, decode: Router, num_prefill: int, num_decode: int) -> None:
        for name, n in (("num_prefill", num_prefill), ("num_decode", num_decode)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {n!r}.")
        self.prefill, self.decode = prefill, decode
        self.num_prefill, self.num_decode = num_prefill, num_decode

    @classmethod
    def of(cls, num_prefill: int, num_decode: int, block_size: int,
           prefill_router: str = "least-outstanding",
           decode_router: str = "least-outstanding") -> DisaggregatedRouter:
        """Routers by name (``routers.make_router``), least-outstanding for both by default."""
        return cls(make_router(prefill_router, block_size), make_router(decode_router, block_size),
                   num_prefill, num_decode)

    def route_prefill(self, request: Request, loads: Sequence[ReplicaLoad]) -> int:
        """The prefill instance for ``request`` (an index into the prefill pool)."""
        self._check(loads, self.num_prefill, "prefill")
        return self.prefill.route(request, loads)

    def route_decode(self, request: Request, prefill_params: dict[str, Any] | None,
                     loads: Sequence[ReplicaLoad]) -> int:
        """The decode instance for ``request``, whose prompt's KV ``prefill_params`` describe
        (the producer's params; the default routers do not read them)."""
        self._check(loads, self.num_decode, "decode")
        return self.decode.route(request, loads)

    @staticmethod
    def _check(loads: Sequence[ReplicaLoad], n: int, pool: str) -> None:
        if len(loads) != n:
            raise ValueError(f"route_{pool}: {len(loads)} loads for a pool of {n} instances.")
