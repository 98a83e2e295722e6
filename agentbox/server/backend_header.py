"""Every response names the server that produced it (`X-Agentbox-Server: host:port`): behind a fleet's
router, `curl -i` (and the fleet test) sees which backend served a turn. Plain ASGI, like
ClientAgentMiddleware: Starlette's BaseHTTPMiddleware cut SSE streams short."""

from __future__ import annotations

import socket
from typing import Any

HEADER = "x-agentbox-server"


class BackendHeaderMiddleware:
    def __init__(self, app: Any, host: str, port: int) -> None:
        self.app = app
        name = socket.gethostname() if host in ("0.0.0.0", "::") else host
        self.value = f"{name}:{port}".encode("latin-1")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER.encode(), self.value)]}
            await send(message)

        await self.app(scope, receive, send_named)
