"""A client that leaves stops its work: waiting for a non-streaming answer or for a stream's first token
(prefill), the route also listens for the client's disconnect, and on it cancels the wait, which closes the
generation and aborts the engine request (its pages come back at the engine's next step). Without this an
abandoned request generated on to max_tokens: two ran ~120 s holding 167 pages."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the log does


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) when the client disconnects first. Only for
    a request whose body has been read: the next ASGI message is then the disconnect."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the route itself is cancelled (server shutdown): so is its work
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone


async def client_gone_handler(_: Request, __: Exception) -> Any:
    return Response(status_code=CLIENT_CLOSED)
