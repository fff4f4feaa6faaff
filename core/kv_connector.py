"""The KV connector seam (vLLM v1's shape) and the Peer connector's scheduler side.

A connector has two halves. The scheduler side (here, torch-free) decides which prompt tokens a
request can load from outside and tells its worker side, once per step, what to move
(``build_connector_meta``). The worker side (``gpu/`` for real, ``simulator/`` in the twin)
moves blocks around the forward pass and reports, in ``ModelRunnerOutput.kv_connector_output``,
which transfers ended. Each side looks its implementation up by ``kv_connector`` name in its own
table; core never imports a worker side.

Disaggregated prefill/decode through the Peer connector::

    prefill engine (producer)                              decode engine (consumer)
    request {"do_remote_decode": True}, max_tokens=1
      prefill, sample 1 token, finish
      request_finished -> delay the free,  --params-->    request {"do_remote_prefill": True,
        params = {engine, host, port, blocks, tokens}       remote_block_ids, ...}
      sends[rid] = block ids (published)                  get_num_new_matched_tokens -> (n, async)
                                                          allocate, WAITING_FOR_REMOTE_KVS
                                          <--reads--      loads[...] = KVLoad(remote -> local)
      finished_sending(rid) -> free blocks                finished_recving(rid) -> scheduled,
                                                            last prompt token recomputed
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from twinserve.core.kv_transfer_config import KVTransferConfig
from twinserve.core.request import Request

if TYPE_CHECKING:
    from twinserve.core.outputs import SchedulerOutput

# A consumer's kv_transfer_params (vLLM's keys) and their types.
CONSUMER_PARAMS: dict[str, type] = {
    "remote_engine_id": str, "remote_block_ids": list, "remote_host": str, "remote_port": int,
    "remote_request_id": str, "remote_num_tokens": int,
}
PARAM_FLAGS = ("do_remote_prefill", "do_remote_decode")


@dataclass(slots=True)
class KVLoad:
    """Consumer: copy remote blocks into these local blocks before the request is scheduled.
    Empty block lists: nothing to copy (the consumer's own cache held the prompt, or the request
    ended before its load was ordered); the worker only tells the producer to release its blocks
    (the producer's transfer_timeout_s stays the backstop for a consumer that never says so)."""

    request_id: str
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    remote_host: str
    remote_port: int


class KVConnectorMetadata:
    """Base class of a connector's per-step orders to its worker side (as vLLM's)."""

    __slots__ = ()


@dataclass(slots=True)
class PeerConnectorMetadata(KVConnectorMetadata):
    """The Peer connector's orders for one step."""

    loads: list[KVLoad] = field(default_factory=list)
    # producer: request id -> block ids kept published for a reader until finished_sending
    sends: dict[str, list[int]] = field(default_factory=dict)
    # request ids whose load or send is abandoned (abort): the worker drops them
    cancelled: list[str] = field(default_factory=list)


@dataclass(slots=True)
class KVConnectorOutput:
    """The worker side's report after a step. A producer reports a send that timed out as
    finished too (its blocks are freed either way)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving)


class KVConnectorScheduler(Protocol):
    """The scheduler side of a connector, one per engine."""

    config: KVTransferConfig

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens past ``num_computed_tokens`` (local hits) the connector can supply,
        and whether it loads them asynchronously."""
        ...

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, out: SchedulerOutput) -> KVConnectorMetadata: ...

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Whether to delay freeing the finished request's blocks, and the params to return."""
        ...

    def request_aborted(self, request_id: str) -> None: ...

    def update_connector_output(self, output: KVConnectorOutput) -> None: ...


class KVConnectorWorker(Protocol):
    """The worker side (real engine: ``gpu/``; twin: ``simulator/``)."""

    def start(self, meta: KVConnectorMetadata) -> None: ...

    def get_finished(self) -> KVConnectorOutput: ...

    def close(self) -> None: ...


def check_kv_transfer_params(params: dict[str, Any]) -> None:
    """Raises ValueError naming the key of a malformed ``kv_transfer_params``."""
    for flag in PARAM_FLAGS:
        if not isinstance(params.get(flag, False), bool):
            raise ValueError(f"kv_transfer_params.{flag} must be a boolean, got {params[flag]!r}.")
    if params.get("do_remote_prefill") and params.get("do_remote_decode"):
        raise ValueError("kv_transfer_params: do_remote_prefill and do_remote_decode exclude "
                         "each other.")
    if not params.get("do_remote_prefill"):
        return
    for key, kind in CONSUMER_PARAMS.items():
        value = params.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"kv_transfer_params.{key} must be {kind.__name__} with "
                             f"do_remote_prefill, got {value!r}.")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in params["remote_block_ids"]):
        raise ValueError("kv_transfer_params.remote_block_ids must be non-negative integers.")
    if params["remote_num_tokens"] < 0:
        raise ValueError("kv_transfer_params.remote_num_tokens must be >= 0, got "
                         f"{params['remote_num_tokens']}.")


class PeerConnectorScheduler:
    """The Peer connector's scheduler side, shared by the engine and the twin.

    Consumer: a ``do_remote_prefill`` request matches the producer's prompt tokens past its own
    prefix-cache hits (whole blocks are copied, the last one partly full) and loads them
    asynchronously. Producer: a ``do_remote_decode`` request that finishes normally keeps its
    blocks until the consumer has read them and returns the consumer's params."""

    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}.")
        self.config = config
        self.block_size = block_size
        self._new_loads: list[KVLoad] = []
        self._new_sends: dict[str, list[int]] = {}
        self._cancelled: list[str] = []
        self.loading: set[str] = set()  # loads ordered and not yet reported
        self.sending: set[str] = set()  # sends ordered and not yet reported

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        remote = min(params["remote_num_tokens"], request.num_prompt_tokens,
                     len(params["remote_block_ids"]) * self.block_size)
        count = remote - num_computed_tokens
        if count > 0:
            return count, True
        # The local cache holds it all: nothing to copy, but the producer may release.
        self._new_loads.append(self._load(request, params, [], []))
        request.kv_transfer_params = {**params, "do_remote_prefill": False}
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not num_external_tokens or not params or not params.get("do_remote_prefill"):
            return
        bs = self.block_size
        first = request.num_computed_tokens // bs
        stop = -(-(request.num_computed_tokens + num_external_tokens) // bs)
        self._new_loads.append(self._load(request, params, params["remote_block_ids"][first:stop],
                                          block_ids[first:stop]))
        self.loading.add(request.request_id)
        # loaded once: a later admission (a failed load's recompute, a preemption) computes
        request.kv_transfer_params = {**params, "do_remote_prefill": False}

    @staticmethod
    def _load(request: Request, params: dict[str, Any], remote: list[int],
              local: list[int]) -> KVLoad:
        return KVLoad(request.request_id, params["remote_engine_id"], params["remote_request_id"],
                      list(remote), list(local), params["remote_host"], params["remote_port"])

    def build_connector_meta(self, out: SchedulerOutput) -> PeerConnectorMetadata:
        meta = PeerConnectorMetadata(self._new_loads, self._new_sends, self._cancelled)
        self._new_loads, self._new_sends, self._cancelled = [], {}, []
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):  # ended before its load was ordered
            self._new_loads.append(self._load(request, params, [], []))  # producer: release
            return False, None
        if not params or not params.get("do_remote_decode") or not block_ids \
                or request.finish_reason not in ("stop", "length"):
            return False, None
        rid = request.request_id
        self._new_sends[rid] = list(block_ids)
        self.sending.add(rid)
        cfg = self.config
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": cfg.engine_id, "remote_block_ids": list(block_ids),
                      "remote_host": cfg.kv_ip, "remote_port": cfg.kv_port,
                      "remote_request_id": rid, "remote_num_tokens": request.num_prompt_tokens}

    def request_aborted(self, request_id: str) -> None:
        """A load never ordered becomes a release notice (nothing to copy, the producer frees
        its blocks); one ordered is cancelled (the worker drops it and releases the producer)."""
        for load in self._new_loads:
            if load.request_id == request_id:
                load.remote_block_ids, load.local_block_ids = [], []
                break
        else:
            self._cancelled.append(request_id)
        self.loading.discard(request_id)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.loading -= output.finished_recving
        self.loading -= output.failed_recving
        self.sending -= output.finished_sending


ConnectorFactory = Callable[[KVTransferConfig, int], KVConnectorScheduler]


def connector_schedulers() -> dict[str, ConnectorFactory]:
    """``kv_connector`` name -> scheduler-side factory ``(config, block_size)``."""
    from twinserve.core.kv_offload import OffloadingConnectorScheduler  # (it imports this module)
    return {"PeerConnector": PeerConnectorScheduler, "OffloadingConnector": OffloadingConnectorScheduler}


def make_connector_scheduler(config: KVTransferConfig, block_size: int) -> KVConnectorScheduler:
    factory = connector_schedulers().get(config.kv_connector)
    if factory is None:
        raise ValueError(f"kv_transfer_config.kv_connector {config.kv_connector!r} has no "
                         "scheduler side in twinserve.")
    return factory(config, block_size)
