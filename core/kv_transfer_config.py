"""The KV connector's configuration, under vLLM's ``--kv-transfer-config`` keys.

Decisions: unknown keys, and unknown keys of ``kv_connector_extra_config``, are refused by name
(a misspelt key must not silently mean "default"); vLLM's connectors that twinserve lacks are
refused by name rather than mapped onto another; ``engine_id`` defaults to one generated per
process, as in vLLM, so that two engines never share an id by accident.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from twinserve.core.json_config import JsonConfig

# The connectors twinserve implements (the scheduler sides: ``core.kv_connector``).
CONNECTORS = ("PeerConnector", "OffloadingConnector")
# vLLM's connectors twinserve does not implement: refused by name.
REFUSED_CONNECTORS = ("NixlConnector", "P2pNcclConnector", "LMCacheConnectorV1", "MooncakeConnector",
                      "SharedStorageConnector", "MultiConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
# kv_connector_extra_config keys twinserve reads, with their defaults.
EXTRA_CONFIG_DEFAULTS: Mapping[str, float] = {"transfer_timeout_s": 30.0}
# The OffloadingConnector's keys (vLLM's): its size in host blocks (core.kv_offload checks it).
OFFLOADING_EXTRA_KEYS = ("num_cpu_blocks",)


def _new_engine_id() -> str:
    return f"engine-{uuid.uuid4().hex[:12]}"


@dataclass(slots=True, frozen=True)
class KVTransferConfig(JsonConfig):
    """What ``--kv-transfer-config`` asks for. ``kv_role``: a producer runs prefills and keeps
    their blocks published for a reader; a consumer loads a producer's blocks before decoding;
    ``kv_both`` does either, per request (``kv_transfer_params`` decide)."""

    CONFIG_NAME: ClassVar[str] = "kv_transfer_config"

    kv_connector: str = "PeerConnector"
    kv_role: str = "kv_both"
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_load_failure_policy: str = "recompute"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector in REFUSED_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector {self.kv_connector!r} is not "
                             f"implemented in twinserve (implemented: {', '.join(CONNECTORS)}).")
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {CONNECTORS}, "
                             f"got {self.kv_connector!r}.")
        _one_of("kv_role", self.kv_role, KV_ROLES)
        _one_of("kv_load_failure_policy", self.kv_load_failure_policy, LOAD_FAILURE_POLICIES)
        if self.engine_id is None:
            object.__setattr__(self, "engine_id", _new_engine_id())
        elif not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(f"kv_transfer_config.engine_id must be a non-empty string, "
                             f"got {self.engine_id!r}.")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config.kv_ip must be a host name or address, "
                             f"got {self.kv_ip!r}.")
        port = self.kv_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be an integer in 1..65535, got {port!r}.")
        self._check_extra()

    def _check_extra(self) -> None:
        extra = self.kv_connector_extra_config
        if not isinstance(extra, Mapping):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a mapping, "
                             f"got {type(extra).__name__}.")
        known = (OFFLOADING_EXTRA_KEYS if self.kv_connector == "OffloadingConnector"
                 else tuple(EXTRA_CONFIG_DEFAULTS))
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key(s) "
                             f"{', '.join(map(str, unknown))} (known: {', '.join(known)}).")
        timeout = extra.get("transfer_timeout_s", EXTRA_CONFIG_DEFAULTS["transfer_timeout_s"])
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.transfer_timeout_s "
                             f"must be a positive number of seconds, got {timeout!r}.")
        object.__setattr__(self, "kv_connector_extra_config", dict(extra))

    @property
    def transfer_timeout_s(self) -> float:
        """A producer frees blocks nobody read by then; a consumer gives up a load after it."""
        return float(self.kv_connector_extra_config.get(
            "transfer_timeout_s", EXTRA_CONFIG_DEFAULTS["transfer_timeout_s"]))

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVTransferConfig:
        return cls(**cls.checked_keys(data))

    def to_dict(self) -> dict[str, Any]:
        """The keys a run's config.json records."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _one_of(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"kv_transfer_config.{name} must be one of {', '.join(valid)}; got {value!r}.")
