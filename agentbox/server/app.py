"""The FastAPI app: lifespan starts the engine core process and loads the tokenizer; routes live in their
own modules. This process never runs the model."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import agentbox
from agentbox import collector
from agentbox.chat.effort import ReasoningEffort
from agentbox.config import ServerConfig
from agentbox.engine.ipc.client import EngineClient, EngineDead, QueryError
from agentbox.engine.stats import to_json
from agentbox.server import anthropic_routes, openai_routes, openapi, responses_routes, sessions_routes
from agentbox.server.access_log import ErrorReasonMiddleware, install_detached_filter, install_polling_filter
from agentbox.server.backend_header import BackendHeaderMiddleware
from agentbox.server.context import served_context
from agentbox.server.disconnect import ClientGone, client_gone_handler
from agentbox.server.errors import (
    RETRY_AFTER_S,
    APIError,
    api_error_handler,
    engine_unavailable_handler,
    error_response,
    http_error_handler,
    recursion_handler,
    unexpected_handler,
    validation_error_handler,
)
from agentbox.server.grammar_gate import GrammarGate
from agentbox.server.guard import RequestGuard, is_loopback
from agentbox.server.model_names import model_names, served_name
from agentbox.server.state import CLIENT_AGENT, CLIENT_NAMESPACE, ServerState

log = logging.getLogger("agentbox.server")


@dataclass(frozen=True)
class ModelDefaults:
    """What the model's profile says about serving it (empty when no profile matches)."""

    sampling: dict[str, float] = field(default_factory=dict)
    thinking: bool = False
    tool_parser: str | None = None
    max_output_tokens: int | None = None
    reasoning_effort: ReasoningEffort | None = None  # for requests that name none; None: the template's default


def model_defaults(model_path: str, name: str) -> ModelDefaults:
    """The profile whose name is in the model's file or directory name (the most specific wins)."""
    from agentbox.hub.profiles import load_profiles

    key = f"{Path(model_path).name} {name}".lower()
    try:
        profiles = load_profiles()
    except Exception:  # profiles are advice; a broken or missing profile dir must not stop serving
        log.warning("could not load model profiles; no sampling defaults applied", exc_info=True)
        return ModelDefaults()
    for p in sorted(profiles, key=lambda p: -len(p.name)):
        if p.name.lower() in key:
            return ModelDefaults(dict(p.sampling), bool(p.reasoning_parser and p.reasoning_parser != "none"),
                                 p.tool_parser or None, p.max_output_tokens, p.reasoning_effort)
    return ModelDefaults()


class ClientAgentMiddleware:
    """Remembers the request's User-Agent for the session table. Plain ASGI: Starlette's BaseHTTPMiddleware
    wraps streaming bodies in a way that cut our SSE streams short."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            agent = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"user-agent"), None)
            CLIENT_AGENT.set(agent)
        await self.app(scope, receive, send)


def create_app(config: ServerConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from agentbox.models.loader import load_tokenizer, resolve_model

        install_polling_filter()  # here, not at import: uvicorn has configured its loggers by now
        engine = EngineClient(config.engine)
        # Model (engine process) and tokenizer (here) load at the same time.
        info_task = asyncio.to_thread(engine.start)
        tok_task = asyncio.to_thread(load_tokenizer, resolve_model(config.engine.model))
        info, tokenizer = await asyncio.gather(info_task, tok_task)
        engine.attach_loop(asyncio.get_running_loop())
        if (give_up := getattr(app.state, "on_engine_give_up", None)) is not None:
            engine.on_give_up = give_up
        d = model_defaults(config.engine.model, served_name(config))
        app.state.agentbox = ServerState(config, engine, tokenizer, info, served_name(config),
                                         sampling_defaults=d.sampling, thinking_model=d.thinking,
                                         tool_parser=d.tool_parser, default_effort=d.reasoning_effort,
                                         default_max_tokens=d.max_output_tokens or config.default_max_tokens,
                                         names=model_names(config, info.model_name),
                                         grammars=GrammarGate(config.engine.model, info.vocab_size,
                                                              info.eos_token_ids))
        if config.record_trace:
            from agentbox.server.trace_recorder import TraceRecorder

            app.state.agentbox.recorder = TraceRecorder(config.record_trace)
            log.info("recording traffic as a replayable trace to %s", config.record_trace)
        context = served_context(config.engine, info)
        app.state.agentbox.context_note = context.describe(info.device)
        log.info("serving %s on http://%s:%d (engine pid %s), %s; it also answers to %s", served_name(config),
                 config.host, config.port, engine.pid, app.state.agentbox.context_note,
                 ", ".join(app.state.agentbox.names[1:]))
        collector.after_startup()  # collections run when the server is idle (agentbox/collector.py)
        try:
            yield
        finally:
            engine.shutdown()
            app.state.agentbox.grammars.close()

    app = FastAPI(title="agentbox", version=agentbox.__version__, lifespan=lifespan)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    # The engine restarting (or the server stopping) is a 503 with Retry-After, never a plain-text 500.
    for exc in (EngineDead, QueryError, asyncio.TimeoutError):
        app.add_exception_handler(exc, engine_unavailable_handler)
    app.add_exception_handler(RecursionError, recursion_handler)
    app.add_exception_handler(ClientGone, client_gone_handler)
    app.add_exception_handler(Exception, unexpected_handler)

    app.add_middleware(ClientAgentMiddleware)
    app.add_middleware(BackendHeaderMiddleware, host=config.host, port=config.port)

    if config.api_key:
        keys = [k.encode() for k in config.api_key.split(",") if k]
        # Several keys: each its own session namespace (one key: everyone who has it is the same client).
        spaces = [f"k{hashlib.sha256(k).hexdigest()[:10]}/" if len(keys) > 1 else "" for k in keys]

        @app.middleware("http")
        async def auth(request: Request, call_next: Any) -> Any:
            path = request.url.path
            if path in ("/", "/health", "/version"):
                return await call_next(request)
            bearer = request.headers.get("authorization", "")
            key = request.headers.get("x-api-key") or (bearer[7:] if bearer.lower().startswith("bearer ") else "")
            # Constant time: every key is compared whole, whatever the sent one's first bytes are.
            hits = [hmac.compare_digest(key.encode(), k) for k in keys]
            if not any(hits):
                message = "invalid x-api-key" if path.startswith("/v1/messages") else "invalid API key"
                return error_response(path, 401, message, "authentication_error", code="invalid_api_key")
            CLIENT_NAMESPACE.set(spaces[hits.index(True)])
            return await call_next(request)

    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(RequestGuard, config=config)  # before auth and routes
    # Added last, so outermost: it logs the reason of every 4xx, the guard's and the auth middleware's too.
    app.add_middleware(ErrorReasonMiddleware)

    @app.get("/")
    @app.head("/", include_in_schema=False)  # one operation in the spec (its id would be GET's twin)
    async def root() -> dict:
        # Claude Code probes `HEAD /` at every start; a 404 there reads as a broken server.
        return {"status": "ok", "name": "agentbox", "version": agentbox.__version__}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        state: ServerState = request.app.state.agentbox
        if state.engine.dead:
            return JSONResponse({"status": "error", "error": state.engine.dead}, 503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        return JSONResponse({"status": "ok", "model": state.model_name})

    @app.get("/version")
    async def version() -> dict:
        return {"version": agentbox.__version__}

    def model_entry(state: ServerState) -> dict:
        return {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "agentbox",
                "max_model_len": state.info.max_model_len, "max_output_tokens": state.default_max_tokens,
                "context_note": state.context_note,
                # what a request without max_tokens may generate (the same number: both names are read)
                "default_max_tokens": state.default_max_tokens,
                "aliases": list(state.names[1:])}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        return {"object": "list", "data": [model_entry(request.app.state.agentbox)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict:
        request.app.state.agentbox.check_model(name)  # any alias; else a 404 naming them
        return model_entry(request.app.state.agentbox)

    @app.get("/v1/stats")
    async def stats(request: Request) -> dict:
        state: ServerState = request.app.state.agentbox
        s = to_json(await state.engine.stats())
        engine = {**vars(state.info), "tensor_parallel_size": state.config.engine.tensor_parallel_size,
                  "cache_policy": state.config.engine.cache_policy.value}
        return {**s, "model": state.model_name, "engine": engine, "pid": os.getpid(),
                "engine_pid": state.engine.pid, "server_uptime_s": time.time() - state.started}

    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(sessions_routes.router)
    openapi.install(app, auth=bool(config.api_key), config=config)
    return app


def exposure_warning(config: ServerConfig) -> str | None:
    """Why a server bound beyond loopback without a key is anyone's on the network (None when it is not)."""
    if is_loopback(config.host) or config.api_key:
        return None
    return (f"--host {config.host} without an API key: anyone who can reach this port can use the model and "
            "read every session. Set one:  AGENTBOX_API_KEY=$(openssl rand -hex 16) agentbox serve "
            f"--host {config.host}")


def run_server(config: ServerConfig, detached: bool = False) -> None:
    """Serves until SIGTERM / SIGINT. Exits 1 when the engine's restart budget ran out (so a supervisor
    such as systemd restarts the server), 3 when the server could not start. `detached`: in the background
    (`agentbox serve`), with no terminal to press Ctrl-C in."""
    import uvicorn

    # INFO on the root logger: the engine process takes its level from here, so its lines (KV pool,
    # max_model_len, loop guard) reach server.log and `agentbox logs` along with the API's warnings.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if (why := exposure_warning(config)) is not None:
        log.warning("%s", why)
    app = create_app(config)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Open streams end with an error event and their end marker now, not cut after the grace period.
            state: ServerState | None = getattr(app.state, "agentbox", None)
            if state is not None and not self.should_exit:
                state.engine.stop_requests("the server is shutting down")
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                   timeout_graceful_shutdown=5))
    if detached:  # after uvicorn.Config, which configures uvicorn's loggers
        install_detached_filter()
    app.state.on_engine_give_up = lambda: setattr(server, "should_exit", True)
    server.run()
    state: ServerState | None = getattr(app.state, "agentbox", None)
    if state is not None and state.engine.gave_up:
        raise SystemExit(1)
    if not server.started:
        raise SystemExit(3)
