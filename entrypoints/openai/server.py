"""The OpenAI-compatible HTTP server (FastAPI + uvicorn), in vLLM's shape.

    python -m twinserve.entrypoints.openai.server --scheduling-policy fcfs --port 8000
    # or, from Python:  run_server(parser.parse_args([...]))   (see add_serve_args)

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming, ``data: [DONE]``),
``/v1/models``, ``/health``, ``/metrics`` (Prometheus, vLLM's names), ``/tokenize``,
``/detokenize``, ``/version``, ``POST /reset_prefix_cache``; with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``, ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``. LoRA adapters (``--enable-lora --lora-modules name=path ...``) are
served under their names as ``model`` (``serving_models``).

``build_app(async_engine, args)`` builds one self-contained app: its state hangs off closures and
``app.state``, its metrics live in its own registry, so two apps in one process share nothing.
Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. A client that goes
away (mid-stream or while waiting for a whole response) has its request aborted, which frees its
KV blocks.

Overload and hostile clients (docs/security.md): a full waiting queue is a 503 with
``Retry-After`` (the engine's ``--max-waiting-requests``/``--max-waiting-tokens``), a tenant over
``--max-tenants`` or ``--max-requests-per-tenant`` a 429, more than ``--max-prompts-per-request``
sequences a 400; streams send their headers once the engine has queued the request and a
``: keep-alive`` comment while it waits; bodies must arrive within ``--body-read-timeout-s``
(408); without an API key only ``--allowed-hosts`` may appear in ``Host`` (DNS rebinding).

This module holds the app and its lifecycle (routes, flags, startup). The handlers live in
``serving_completion``, ``serving_chat`` and ``serving_tokenization``; what they share (validation,
the ``Generation``, SSE) in ``generation``; the per-app state in ``server_state``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import twinserve
from twinserve.entrypoints.engine_args import (
    add_engine_args,
    add_pool_args,
    apply_config_file,
    engine_args_from,
)
from twinserve.entrypoints.openai.async_engine import AsyncEngine, EngineDeadError
from twinserve.entrypoints.openai.chat_server_options import add_chat_args, checked_chat_options
from twinserve.entrypoints.openai.http_errors import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    CatchAllMiddleware,
    ClientGone,
    HostCheckMiddleware,
    bound_host_names,
    error_response,
    install_error_handlers,
)
from twinserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from twinserve.entrypoints.openai.server_cors import (
    add_cors_args,
    add_model_tag_arg,
    cors_options,
    install_cors,
    resolve_model_tag,
)
from twinserve.entrypoints.openai.server_metrics import ServerMetrics, cache_config_labels
from twinserve.entrypoints.openai.server_state import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_TENANTS,
    DEFAULT_SSE_KEEPALIVE_S,
    ServerLimits,
    ServerState,
    TenantTracker,
)
from twinserve.entrypoints.openai.serving_chat import create_chat_completion
from twinserve.entrypoints.openai.serving_completion import create_completion
from twinserve.entrypoints.openai.serving_embedding import EmbeddingRequest, create_embedding
from twinserve.entrypoints.openai.serving_models import (
    RUNTIME_LORA_ENV,
    LoRARegistry,
    load_lora_adapter,
    max_loras_of,
    model_list,
    parse_lora_module,
    public_name,
    register_static_loras,
    runtime_lora_updating,
    static_lora_modules,
    unload_lora_adapter,
)
from twinserve.entrypoints.openai.serving_tokenization import detokenize, tokenize
from twinserve.entrypoints.pd_front import PDDeployment
from twinserve.routers import router_class

logger = logging.getLogger("twinserve.server")

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
API_KEY_ENV_VARS = ("TWINSERVE_API_KEY", "VLLM_API_KEY")
MAX_API_KEYS = 4096
METRICS_SNAPSHOT_TIMEOUT_S = 30.0


# ==== app state ==================================================================================
def _state(request: Request) -> ServerState:
    return request.app.state.twinserve


# ==== the small endpoints ========================================================================
def _engine_snapshot(engine: Any) -> tuple[Any, Any, dict[str, int] | None]:
    """On the engine thread: the scheduler's stats, the new finished-request records and the
    running sequences per adapter (None without LoRA)."""
    loras = getattr(engine.scheduler, "loras", None)
    return (engine.scheduler.stats(), engine.metrics.take_requests(),
            dict(loras.users) if loras is not None else None)


async def render_metrics(state: ServerState) -> Response:
    metrics = state.metrics
    replicas = getattr(state.async_engine, "replicas", None)
    if replicas is not None:  # data parallel: the front holds each replica's last stats
        front = state.async_engine.front  # type: ignore[attr-defined]
        metrics.take_replica_snapshot([r.stats for r in replicas()], front.take_records(),
                                      front.take_step_tokens())
    elif state.async_engine.is_alive:
        try:
            stats, records, running = await asyncio.wait_for(
                state.async_engine.call(_engine_snapshot), timeout=METRICS_SNAPSHOT_TIMEOUT_S)
            metrics.take_engine_snapshot(stats, records)
            if running is not None:
                metrics.take_lora_snapshot(sorted(public_name(k) for k in running),
                                           state.loras.waiting(running))
        except (TimeoutError, EngineDeadError):
            pass  # the last snapshot stands
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _num_engines(async_engine: Any) -> int:
    """The data-parallel replicas behind the app (0: one engine, no ``engine`` label)."""
    front = getattr(async_engine, "front", None)
    return 0 if front is None else int(front.size)


# ==== the app ====================================================================================
def build_app(async_engine: AsyncEngine, args: argparse.Namespace) -> FastAPI:
    """One self-contained app over a running ``AsyncEngine``. ``args`` as from
    ``add_serve_args`` (missing attributes take their defaults)."""
    engine = async_engine.engine
    model_root = str(getattr(engine.runner, "model_dir", "") or "") or None
    model_name = served_model_name(args, model_root)
    limits = server_limits(args)
    loras = LoRARegistry(model_name)
    register_static_loras(async_engine, loras, static_lora_modules(args, model_name))
    state = ServerState(async_engine=async_engine, model_name=model_name,
                        model_root=model_root, max_model_len=int(engine.runner.max_model_len),
                        metrics=ServerMetrics(model_name, max_loras_of(engine),
                                              int(engine.runner.max_model_len),
                                              cache_config_labels(async_engine),
                                              _num_engines(async_engine)), loras=loras,
                        limits=limits,
                        tenants=TenantTracker(limits.max_tenants, limits.max_requests_per_tenant),
                        chat=checked_chat_options(args, getattr(engine, "tokenizer", None)))
    if hasattr(engine, "driver"):  # vllm:iteration_tokens_total, on the engine thread
        engine.driver.observers.append(state.metrics)
    app = FastAPI(title="twinserve", version=twinserve.__version__, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.twinserve = state
    install_error_handlers(app)
    add_routes(app)
    if runtime_lora_updating():
        logger.warning("%s is set: LoRA adapters can be loaded and unloaded at runtime "
                       "(/v1/load_lora_adapter, /v1/unload_lora_adapter); the server reads "
                       "any adapter directory a client names.", RUNTIME_LORA_ENV)
        add_lora_routes(app)
    # add_middleware wraps: the last added runs first (catch-all, Host, CORS, API key, body).
    timeout = getattr(args, "body_read_timeout_s", DEFAULT_BODY_READ_TIMEOUT_S)
    app.add_middleware(BodySizeLimitMiddleware,
                       max_bytes=int(getattr(args, "max_request_body_bytes", None)
                                     or DEFAULT_MAX_REQUEST_BODY_BYTES),
                       read_timeout_s=float(timeout) if timeout and timeout > 0 else None)
    api_keys = resolve_api_keys(args)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    elif getattr(args, "tenant_from_api_key", False):
        raise ValueError("--tenant-from-api-key needs API keys (--api-key, --api-key-file or "
                         "$TWINSERVE_API_KEY).")
    install_cors(app, cors_options(args))  # before the key check: preflights carry none
    hosts = allowed_hosts(args, bool(api_keys))
    if hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed=hosts[0], allow_ip_literals=hosts[1])
    app.add_middleware(CatchAllMiddleware)
    return app


def server_limits(args: argparse.Namespace) -> ServerLimits:
    def positive(name: str, default: int) -> int:
        value = getattr(args, name, None)
        value = default if value is None else int(value)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")
        return value

    per_tenant = int(getattr(args, "max_requests_per_tenant", None) or 0)
    if per_tenant < 0:
        raise ValueError(f"--max-requests-per-tenant must be >= 0, got {per_tenant}.")
    keepalive = getattr(args, "sse_keepalive_s", None)
    return ServerLimits(
        max_prompts_per_request=positive("max_prompts_per_request",
                                         DEFAULT_MAX_PROMPTS_PER_REQUEST),
        max_tenants=positive("max_tenants", DEFAULT_MAX_TENANTS),
        max_requests_per_tenant=per_tenant,
        trust_tenant_header=bool(getattr(args, "trust_tenant_header", False)),
        tenant_from_api_key=bool(getattr(args, "tenant_from_api_key", False)),
        sse_keepalive_s=float(keepalive) if keepalive else DEFAULT_SSE_KEEPALIVE_S)


def allowed_hosts(args: argparse.Namespace,
                  api_key: bool) -> tuple[frozenset[str], bool] | None:
    """``(names, allow IP literals)`` the Host header must match, or None for any. Default:
    with an API key any; without one the loopback names and ``--host`` (any IP address too when
    ``--host`` is a wildcard such as 0.0.0.0)."""
    given = getattr(args, "allowed_hosts", None)
    host = str(getattr(args, "host", None) or "127.0.0.1")
    if given:
        names = [h.strip().strip("[]").lower() for h in str(given).split(",") if h.strip()]
        if "*" in names:
            return None
        return frozenset(names), False
    if api_key:
        return None
    return bound_host_names(host), host.strip("[]") in WILDCARD_HOSTS


def add_routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _guard(create_completion(_state(request), body, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _guard(create_chat_completion(_state(request), body, request))

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await _guard(create_embedding(_state(request), body, request))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return JSONResponse(model_list(_state(request)).model_dump())

    @app.get("/health")
    async def health(request: Request) -> Response:
        engine = _state(request).async_engine
        if getattr(engine, "replicas", None) is not None:
            return replica_health(engine.replicas(), engine.is_alive)  # type: ignore[attr-defined]
        if engine.is_alive:
            return Response(status_code=200)
        return error_response(503, "The engine thread is not running.")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return await render_metrics(_state(request))

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest, request: Request) -> Response:
        return JSONResponse(tokenize(_state(request), body).model_dump())

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest, request: Request) -> Response:
        return JSONResponse(detokenize(_state(request), body).model_dump())

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": twinserve.__version__})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        done = await _state(request).async_engine.call(
            lambda e: e.scheduler.kv.reset_prefix_cache())
        return JSONResponse({"reset": bool(done)})


def add_lora_routes(app: FastAPI) -> None:
    """vLLM's runtime adapter endpoints (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    @app.post("/v1/load_lora_adapter")
    async def load_lora(body: LoadLoRAAdapterRequest, request: Request) -> Response:
        return await load_lora_adapter(_state(request), body)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
        return await unload_lora_adapter(_state(request), body)


async def _guard(work: Awaitable[Response]) -> Response:
    """A client that left gets no answer (499 goes nowhere); the request was aborted."""
    try:
        return await work
    except ClientGone:
        return Response(status_code=499)


# ==== configuration and startup ==================================================================
def served_model_name(args: argparse.Namespace, model_root: str | None) -> str:
    name = getattr(args, "served_model_name", None)
    if name:
        return name
    model = getattr(args, "model", None)
    if model:
        return str(model)
    from twinserve.gpu.models.default_model import MODEL_NAME
    return MODEL_NAME


def resolve_api_keys(args: argparse.Namespace) -> dict[str, str]:
    """The accepted API keys, each with its name: ``--api-key`` (named key1, key2, ...), else
    the lines of ``--api-key-file`` (``KEY`` or ``NAME KEY``), else ``$TWINSERVE_API_KEY``,
    else ``$VLLM_API_KEY``; empty: no key."""
    given = getattr(args, "api_key", None)
    if given:
        keys = [given] if isinstance(given, str) else list(given)
        return _named_keys([(f"key{i + 1}", key) for i, key in enumerate(keys)], "--api-key")
    path = getattr(args, "api_key_file", None)
    if path:
        return _named_keys(_read_key_file(path), f"--api-key-file {path}")
    for var in API_KEY_ENV_VARS:
        if os.environ.get(var):
            return {os.environ[var]: "key1"}
    return {}


def _read_key_file(path: str) -> list[tuple[str, str]]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.split() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path}: {getattr(exc, 'strerror', None) or exc}") \
            from exc
    if not lines:
        raise ValueError(f"--api-key-file {path} is empty.")
    if any(len(fields) > 2 for fields in lines):
        raise ValueError(f"--api-key-file {path}: each line holds KEY or NAME KEY.")
    return [(f[0], f[1]) if len(f) == 2 else (f"key{i + 1}", f[0]) for i, f in enumerate(lines)]


def _named_keys(pairs: list[tuple[str, str]], source: str) -> dict[str, str]:
    if len(pairs) > MAX_API_KEYS:
        raise ValueError(f"{source}: at most {MAX_API_KEYS} API keys, got {len(pairs)}.")
    keys: dict[str, str] = {}
    for name, key in pairs:
        if key in keys:
            raise ValueError(f"{source}: the key named {name!r} repeats the key named "
                             f"{keys[key]!r}.")
        if name in keys.values():
            raise ValueError(f"{source}: the key name {name!r} is used twice.")
        keys[key] = name
    return keys


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ``twinserve serve``'s flags to ``parser``: ``--model``, the real engine's knobs
    (``engine_args.add_engine_args``, vLLM's names, shared with the other subcommands) and the
    server's own."""
    add_model_tag_arg(parser)
    parser.add_argument("--model", default=None,
                        help="HF model directory (default: the bundled SmolLM2-135M-Instruct)")
    add_engine_args(parser)
    pd = parser.add_argument_group("disaggregated prefill/decode (docs/disaggregation.md)")
    pd.add_argument("--prefill-instances", type=int, default=None, metavar="X",
                    help="X prefill engine processes (with --decode-instances): each request's "
                         "prefill runs on one, its decode on a decode instance that loads its KV")
    pd.add_argument("--decode-instances", type=int, default=None, metavar="Y",
                    help="Y decode engine processes (with --prefill-instances)")
    add_pool_args(pd)
    server = parser.add_argument_group("server")
    server.add_argument("--hardware", default=None, metavar="PROFILE",
                        help="the GPU profile a planned configuration was sized for (twinserve "
                             "plan's best.yaml): the server warns when this machine differs")
    server.add_argument("--served-model-name", default=None,
                        help="the model id clients send (default: --model as given)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", default=None, nargs="+", metavar="KEY",
                        help="require Authorization: Bearer KEY, one of these keys. A flag's "
                             "value is visible to every user in the process list: prefer "
                             "--api-key-file or the environment (default: $TWINSERVE_API_KEY, "
                             "then $VLLM_API_KEY)")
    server.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="read the API keys from PATH, one per line as KEY or NAME KEY")
    server.add_argument("--tenant-from-api-key", action="store_true",
                        help="the fairness tenant is the name of the request's API key "
                             "(key1, key2, ... or the file's NAME); 'user' and X-Tenant are "
                             "ignored, so tenants are bounded by the keys")
    server.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                        help="comma-separated names the Host header may carry ('*': any). "
                             "Default: any with an API key; otherwise localhost, 127.0.0.1, "
                             "::1 and --host (and any IP address if --host is 0.0.0.0 or ::), "
                             "against DNS rebinding")
    server.add_argument("--max-request-body-bytes", type=int,
                        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get 413 (default 1 MiB)")
    server.add_argument("--body-read-timeout-s", type=float, default=DEFAULT_BODY_READ_TIMEOUT_S,
                        help="a request body not received within this many seconds gets 408 "
                             "(default 30; 0: no limit)")
    server.add_argument("--max-prompts-per-request", type=int,
                        default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                        help="at most this many sequences (prompts x n) per API call, else 400 "
                             "(default 256)")
    server.add_argument("--max-tenants", type=int, default=DEFAULT_MAX_TENANTS,
                        help="at most this many tenants with requests in flight; a new one "
                             "gets 429 (default 1024)")
    server.add_argument("--max-requests-per-tenant", type=int, default=0,
                        help="at most this many engine requests in flight per tenant, else "
                             "429 (default 0: no limit)")
    server.add_argument("--trust-tenant-header", action="store_true",
                        help="take the fairness tenant from the X-Tenant header (set it only "
                             "behind a gateway that sets it); default: the request's 'user'")
    server.add_argument("--sse-keepalive-s", type=float, default=DEFAULT_SSE_KEEPALIVE_S,
                        help="a stream with nothing to send for this long sends a "
                             "': keep-alive' comment (default 5)")
    server.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                        metavar="NAME=PATH",
                        help="LoRA adapters to serve (with --enable-lora), each as name=path or "
                             "vLLM's JSON '{\"name\": ..., \"path\": ..., "
                             "\"base_model_name\": ...}'; a request picks one by its name as "
                             "model. Each is loaded at start-up: a bad one stops the server")
    add_chat_args(server)
    add_cors_args(server)
    server.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser


def replica_health(replicas: list[Any], front_alive: bool) -> Response:
    """vLLM answers /health 200 while its engine cores all run and 503 once one is dead (its
    data-parallel client does not restart one). Here: 200 when every replica is ready, else
    503 in OpenAI's error shape; both carry each replica's state (``engine`` as vLLM's label)."""
    rows = [{"engine": str(i), "state": r.state, "restarts": r.restarts}
            for i, r in enumerate(replicas)]
    if front_alive and all(r.state == "ready" for r in replicas):
        return JSONResponse({"replicas": rows})
    down = ", ".join(f"{row['engine']} ({row['state']})" for row in rows
                     if row["state"] != "ready") or "the front"
    response = error_response(503, f"Replicas not serving: {down}.")
    body = json.loads(bytes(response.body))
    body["replicas"] = rows
    return JSONResponse(body, status_code=503)


def build_async_engine(args: argparse.Namespace) -> Any:
    from twinserve.gpu.engine.llm_engine import LLMEngine
    resolve_model_tag(args)
    engine_args = engine_args_from(args, model=args.model)
    pd = PDDeployment.of(*(getattr(args, k, None) for k in
                           ("prefill_instances", "decode_instances", "prefill_args",
                            "decode_args")))
    if engine_args.data_parallel_size > 1 or pd is not None:
        from twinserve.entrypoints.openai.dp_async_engine import DPAsyncEngine
        return DPAsyncEngine(engine_args, pd)
    router_class(engine_args.router)  # (one replica routes nothing; a misspelt name is refused)
    engine = LLMEngine(engine_args, usage_context="server")
    engine.metrics.record_steps = False  # a server runs for days: keep no per-step rows
    return AsyncEngine(engine)


def warn_other_hardware(profile: str | None) -> None:
    """With ``--hardware`` (a planned configuration), warns when this machine's device is not the
    profile's kind or its memory differs by more than 5% (batch limits were sized for it)."""
    if profile is None:
        return
    import torch

    from twinserve.simulator.hardware import load_hardware
    hw = load_hardware(profile)  # ValueError naming an unknown profile, before the engine loads
    wanted = hw.platform().device_type
    have = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted != have:
        logger.warning("twinserve: this configuration was planned for %s (%s); running on %s",
                       hw.name, wanted, have)
    elif have == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        if abs(total - hw.mem_capacity) > 0.05 * hw.mem_capacity:
            logger.warning("twinserve: this configuration was planned for %s (%.0f GiB); this "
                           "device has %.0f GiB", hw.name, hw.mem_capacity / 2**30, total / 2**30)


def run_server(args: argparse.Namespace) -> None:
    """Builds the engine from ``args``, serves until SIGINT/SIGTERM, then stops the engine."""
    import uvicorn
    resolve_model_tag(args)
    cors_options(args)  # a bad combination before the engine loads
    if getattr(args, "lora_modules", None) and not getattr(args, "enable_lora", None):
        raise ValueError("--lora-modules needs --enable-lora (LoRA adapters are served only "
                         "with LoRA enabled).")
    static_lora_modules(args, served_model_name(args, None))  # a bad entry before the engine
    warn_other_hardware(getattr(args, "hardware", None))
    async_engine = build_async_engine(args)
    try:
        app = build_app(async_engine, args)
        # lifespan off: the app has no startup or shutdown hooks (the engine is built before
        # and stopped after), and a lifespan task cancelled by a second SIGINT logs a traceback
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level=getattr(args, "uvicorn_log_level", "warning"),
                                timeout_graceful_shutdown=5, lifespan="off")
        logger.warning("twinserve: serving %s on http://%s:%d",
                       served_model_name(args, None), args.host, args.port)
        uvicorn.Server(config).run()
    finally:
        async_engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="twinserve serve",
                                     description="OpenAI-compatible server")
    add_serve_args(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        run_server(apply_config_file(parser, argv or sys.argv[1:]))
    except (ValueError, FileNotFoundError) as exc:
        print(f"twinserve serve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # (uvicorn raises the SIGINT it caught again once it has stopped)
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
