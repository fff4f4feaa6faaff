"""``ServerState``: what one app's handlers share (the engine, the served name and adapters, the
metrics, the per-request limits and the active tenants)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twinserve.entrypoints.openai.async_engine import AsyncEngine
from twinserve.entrypoints.openai.chat_server_options import ChatServerOptions
from twinserve.entrypoints.openai.http_errors import APIError
from twinserve.entrypoints.openai.server_metrics import ServerMetrics
from twinserve.entrypoints.openai.serving_models import LoRARegistry

DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
DEFAULT_MAX_TENANTS = 1024
DEFAULT_SSE_KEEPALIVE_S = 5.0
MAX_TENANT_NAME_CHARS = 256


@dataclass(slots=True, frozen=True)
class ServerLimits:
    """What one API call may ask for. ``max_requests_per_tenant`` 0 = no per-tenant limit."""

    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_tenants: int = DEFAULT_MAX_TENANTS
    max_requests_per_tenant: int = 0
    trust_tenant_header: bool = False
    tenant_from_api_key: bool = False
    sse_keepalive_s: float = DEFAULT_SSE_KEEPALIVE_S


@dataclass(slots=True)
class TenantTracker:
    """Engine requests in flight per tenant (an entry only while it has one), so that one client
    cannot create tenants without bound (``max_tenants``) or flood the queue as one tenant
    (``max_requests_per_tenant``): both answered 429."""

    max_tenants: int
    max_requests_per_tenant: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)

    def acquire(self, tenant: str, num_requests: int) -> None:
        held = self.in_flight.get(tenant, 0)
        if held == 0 and len(self.in_flight) >= self.max_tenants:
            raise APIError(429, f"Too many active tenants ({self.max_tenants}, --max-tenants): "
                                "retry when some of their requests have finished.", "user",
                           {"Retry-After": "1"})
        if self.max_requests_per_tenant and held + num_requests > self.max_requests_per_tenant:
            raise APIError(429, f"Tenant {tenant!r} has {held} requests in flight and asked for "
                                f"{num_requests} more; the limit is "
                                f"{self.max_requests_per_tenant} (--max-requests-per-tenant).",
                           "user", {"Retry-After": "1"})
        self.in_flight[tenant] = held + num_requests

    def release(self, tenant: str, num_requests: int) -> None:
        left = self.in_flight.get(tenant, 0) - num_requests
        if left > 0:
            self.in_flight[tenant] = left
        else:
            self.in_flight.pop(tenant, None)


@dataclass(slots=True)
class ServerState:
    async_engine: AsyncEngine
    model_name: str
    model_root: str | None
    max_model_len: int
    metrics: ServerMetrics
    loras: LoRARegistry  # the served adapters (none without --enable-lora)
    limits: ServerLimits = field(default_factory=ServerLimits)
    tenants: TenantTracker = field(
        default_factory=lambda: TenantTracker(DEFAULT_MAX_TENANTS))
    chat: ChatServerOptions = field(default_factory=ChatServerOptions)

    @property
    def engine(self) -> Any:
        return self.async_engine.engine

    @property
    def tokenizer(self) -> Any:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "This model has no tokenizer: send prompts as token ids.")
        return tok
