"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status."""

from __future__ import annotations

import json

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


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _loc_to_param(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), exc.status, headers=exc.headers)


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


async def http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(exc.detail), type_), exc.status_code, headers=getattr(exc, "headers", None))


def parse_json_body(raw: bytes) -> dict:
    """Strict JSON body parse with an OpenAI-shaped 400 on failure."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body
