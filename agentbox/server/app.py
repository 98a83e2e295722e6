"""The FastAPI app: lifespan starts the engine core process and loads the tokenizer; routes live in their
own modules. This process never runs the model."""

from __future__ import annotations

import asyncio
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
from agentbox.config import ServerConfig
from agentbox.engine.client import EngineClient
from agentbox.engine.messages import to_json
from agentbox.server import anthropic_routes, openai_routes, responses_routes, sessions_routes
from agentbox.server.backend_header import BackendHeaderMiddleware
from agentbox.server.errors import (
    APIError,
    api_error_handler,
    error_body,
    http_error_handler,
    validation_error_handler,
)
from agentbox.server.generation import CLIENT_AGENT, ServerState

log = logging.getLogger("agentbox.server")


def served_name(config: ServerConfig) -> str:
    if config.served_model_name:
        return config.served_model_name
    p = Path(config.engine.model)
    name = p.stem if p.suffix == ".gguf" else p.name
    return name or "model"


@dataclass(frozen=True)
class ModelDefaults:
    """What the model's profile says about serving it (empty when no profile matches)."""

    sampling: dict[str, float] = field(default_factory=dict)
    thinking: bool = False
    tool_parser: str | None = None
    max_output_tokens: int | None = None


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
                                 p.tool_parser or None, p.max_output_tokens)
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

        engine = EngineClient(config.engine)
        # Model (engine process) and tokenizer (here) load at the same time.
        info_task = asyncio.to_thread(engine.start)
        tok_task = asyncio.to_thread(load_tokenizer, resolve_model(config.engine.model))
        info, tokenizer = await asyncio.gather(info_task, tok_task)
        engine.attach_loop(asyncio.get_running_loop())
        d = model_defaults(config.engine.model, served_name(config))
        app.state.agentbox = ServerState(config, engine, tokenizer, info, served_name(config),
                                         sampling_defaults=d.sampling, thinking_model=d.thinking,
                                         tool_parser=d.tool_parser,
                                         default_max_tokens=d.max_output_tokens or config.default_max_tokens)
        if config.engine.record_trace:
            from agentbox.bench.record import TraceRecorder

            app.state.agentbox.recorder = TraceRecorder(config.engine.record_trace)
            log.info("recording traffic as a replayable trace to %s", config.engine.record_trace)
        log.info("serving %s on http://%s:%d (engine pid %s)", served_name(config), config.host, config.port, engine.pid)
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="agentbox", version=agentbox.__version__, lifespan=lifespan)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)

    app.add_middleware(ClientAgentMiddleware)
    app.add_middleware(BackendHeaderMiddleware, host=config.host, port=config.port)

    if config.api_key:
        @app.middleware("http")
        async def auth(request: Request, call_next: Any) -> Any:
            path = request.url.path
            if path in ("/", "/health", "/version"):
                return await call_next(request)
            bearer = request.headers.get("authorization", "")
            key = request.headers.get("x-api-key") or (bearer[7:] if bearer.lower().startswith("bearer ") else None)
            if key != config.api_key:
                if path.startswith("/v1/messages"):  # Anthropic clients read Anthropic's error shape
                    return anthropic_routes.anthropic_error(401, "invalid x-api-key")
                return JSONResponse(error_body("invalid API key", "authentication_error"), 401)
            return await call_next(request)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> dict:
        # Claude Code probes `HEAD /` at every start; a 404 there reads as a broken server.
        return {"status": "ok", "name": "agentbox", "version": agentbox.__version__}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        state: ServerState = request.app.state.agentbox
        if state.engine.dead:
            return JSONResponse({"status": "error", "error": state.engine.dead}, 503)
        return JSONResponse({"status": "ok", "model": state.model_name})

    @app.get("/version")
    async def version() -> dict:
        return {"version": agentbox.__version__}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        state: ServerState = request.app.state.agentbox
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "agentbox",
            "max_model_len": state.info.max_model_len, "max_output_tokens": state.default_max_tokens,
        }]}

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
    return app


def run_server(config: ServerConfig) -> None:
    import uvicorn

    # INFO on the root logger: the engine process takes its level from here, so its lines (KV pool,
    # max_model_len, loop guard) reach server.log and `agentbox logs` along with the API's warnings.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=5)
