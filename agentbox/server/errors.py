"""Errors as JSON in the shape of the API the client speaks: OpenAI's {"error": {"message", "type", "param",
"code"}}, or Anthropic's {"type": "error", "error": {"type", "message"}} on /v1/messages. Never plain text:
an engine restart is a 503 with Retry-After, input too deep for the parser a 400, and anything unforeseen
a JSON 500 (logged with its traceback)."""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        type_: str = "invalid_request_error", headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_
        self.headers = headers


log = logging.getLogger("agentbox.server")
RETRY_AFTER_S = 5  # what a 503 asks a client to wait: about an engine restart on CPU

ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status, headers=headers)


def speaks_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The error in the shape the route's clients read."""
    if speaks_anthropic(path):
        return anthropic_error(status, message, headers)
    return JSONResponse(error_body(message, type_, param, code), status, headers=headers)


def unavailable(path: str, why: str) -> JSONResponse:
    """A 503 while the engine restarts (or the server stops): clients retry after Retry-After."""
    return error_response(path, 503, f"the engine is unavailable ({why}); retry in {RETRY_AFTER_S} s",
                          "overloaded_error", code="engine_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


def as_api_error(exc: BaseException) -> APIError:
    """An exception met mid-stream, after the 200 went out, as the typed error event the stream ends with."""
    if isinstance(exc, APIError):
        return exc
    from agentbox.engine.ipc.client import EngineDead, QueryError

    if isinstance(exc, EngineDead | QueryError | TimeoutError):
        return APIError(503, f"the engine is unavailable ({exc}); retry in {RETRY_AFTER_S} s",
                        code="engine_unavailable", type_="overloaded_error")
    log.error("unexpected error in a stream", exc_info=exc)
    return APIError(500, f"internal error ({type(exc).__name__}); the server log has the details",
                    code="internal_error", type_="server_error")


async def engine_unavailable_handler(request: Request, exc: Exception) -> JSONResponse:
    return unavailable(request.url.path, str(exc) or type(exc).__name__)


async def recursion_handler(request: Request, exc: Exception) -> JSONResponse:
    return error_response(request.url.path, 400, "the request is nested too deeply to read; flatten it",
                          code="too_deep")


async def unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(request.url.path, 500, f"internal error ({type(exc).__name__}); the server log has "
                          "the details", "server_error", code="internal_error")


def _loc_to_param(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(request.url.path, exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errs = exc.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        msg = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}"
        return JSONResponse(error_body(msg, "invalid_request_error", None, "invalid_json"), 400)
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = f"'{param}': {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid request"))
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more problem(s))"
    return JSONResponse(error_body(msg, "invalid_request_error", param or None, "invalid_value"), 400)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(request.url.path, exc.status_code, str(exc.detail), type_,
                          headers=getattr(exc, "headers", None))


def parse_json_body(raw: bytes) -> dict:
    """Strict JSON body parse with an OpenAI-shaped 400 on failure."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    except RecursionError as e:
        raise APIError(400, "the request body is nested too deeply to read; flatten it", code="too_deep") from e
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body
