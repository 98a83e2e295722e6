"""What the server log says about requests: polling endpoints' access lines only at debug level (`agentbox
top` polls /v1/stats and /v1/sessions every second; at info they buried everything else), and every 4xx
answer logged with its reason, so a client's failing request can be diagnosed from `agentbox logs` alone."""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("agentbox.server")

# GET endpoints that dashboards, health checks and scrapers call on a timer. A 4xx/5xx on them still logs.
POLLING_PATHS = frozenset({"/health", "/version", "/metrics", "/v1/models", "/v1/stats", "/v1/sessions"})
# An error body is one small JSON object; past this it is not read for a reason.
MAX_ERROR_BODY = 16 * 1024


def is_polling(method: str, path: str) -> bool:
    path = path.split("?", 1)[0]
    return method in ("GET", "HEAD") and (path in POLLING_PATHS or path.startswith("/v1/sessions/"))


class PollingAccessFilter(logging.Filter):
    """On uvicorn's access logger: a successful poll becomes a DEBUG record, dropped unless that logger is
    set to debug (`uvicorn --log-level debug`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client address, method, path with query, http version, status code)
        if not (isinstance(args, tuple) and len(args) == 5):
            return True
        _, method, path, _, status = args
        if not (isinstance(status, int) and status < 400 and is_polling(str(method), str(path))):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def install_polling_filter() -> None:
    """Idempotent: run_server may build more than one app in a process (tests)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, PollingAccessFilter) for f in access.filters):
        access.addFilter(PollingAccessFilter())


class DetachedHintFilter(logging.Filter):
    """On uvicorn's error logger of a background server: its start line's "(Press CTRL+C to quit)" is wrong
    there (no terminal; `agentbox stop` stops it)."""

    HINT = " (Press CTRL+C to quit)"

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and self.HINT in record.msg:
            record.msg = record.msg.replace(self.HINT, "")
            if hasattr(record, "color_message"):  # the same line, colored, for a terminal
                record.color_message = record.msg
        return True


def install_detached_filter() -> None:
    logging.getLogger("uvicorn.error").addFilter(DetachedHintFilter())


def error_reason(body: bytes) -> str:
    """The message of an OpenAI- or Anthropic-shaped error body ({"error": {"message": ...}}), else the
    body's text (FastAPI's {"detail": ...} included)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body.decode("utf-8", "replace").strip()[:300] or "(no body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "detail" in data:
            return str(data["detail"])
    return json.dumps(data)[:300]


class ErrorReasonMiddleware:
    """Logs one WARNING line per 4xx answer: status, method, path and the error message the client got
    (which names the field). Plain ASGI, and it only reads the body of error answers: streams pass as they
    are."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = bytearray()

        async def watch(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and 400 <= status < 500:
                if len(body) < MAX_ERROR_BODY:
                    body.extend(message.get("body", b"")[: MAX_ERROR_BODY - len(body)])
                if not message.get("more_body", False):
                    log.warning("%d %s %s: %s", status, scope.get("method", "?"), scope.get("path", "?"),
                                error_reason(bytes(body)))
            await send(message)

        await self.app(scope, receive, watch)
