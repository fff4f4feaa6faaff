"""KV connector protocol (vLLM v1's shape). PLACEHOLDER written from /tmp/mv/pd_interface.md by the
hosttier helper until pd-twin's core commit lands; at the merge pd-twin's file wins."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from twinserve.core.outputs import SchedulerOutput
from twinserve.core.request import Request


class KVConnectorMetadata:
    """Base class of a connector's per-step orders to its worker side."""

    __slots__ = ()


@dataclass(slots=True)
class KVConnectorOutput:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class KVConnectorScheduler(Protocol):
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]: ...
    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None: ...
    def build_connector_meta(self, out: SchedulerOutput) -> KVConnectorMetadata: ...
    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]: ...
    def request_aborted(self, request_id: str) -> None: ...
    def update_connector_output(self, output: KVConnectorOutput) -> None: ...


class KVConnectorWorker(Protocol):
    def start(self, meta: KVConnectorMetadata) -> None: ...
    def get_finished(self) -> KVConnectorOutput: ...
    def close(self) -> None: ...
