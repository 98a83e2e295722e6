"""Checks every HTTP request gets before a route reads it: what a web page or a careless client could
send to a server on the user's own machine.

- Host: a server bound to loopback answers only to loopback names (421 otherwise). A page on
  evil.example that re-resolves its name to 127.0.0.1 (DNS rebinding) still sends `Host: evil.example`. The
  whole value must be `name` or `name:port` (digits) with the name allowed: `localhost:8000@evil.example` and
  `localhost:evil` are refused, not read as `localhost`, and so is a request with two Host headers.
- Method: a POST to a path that has no POST route goes to the router unchecked, which answers 405 (not the
  415 of a body check that does not apply).
- Content-Type: every POST must say JSON (415 otherwise). A cross-site form or `fetch` with `text/plain`
  needs no CORS preflight, so without this check any page the user opens could run generations.
- Size: headers (431) and body (413) are bounded before they are read whole; the JSON is parsed off the
  event loop and refused (400) when nested deeper than MAX_JSON_DEPTH or carrying a lone UTF-16
  surrogate, which the tokenizer and the template engine cannot take.

Plain ASGI (Starlette's BaseHTTPMiddleware cut SSE streams short, see app.py), outermost.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
from typing import Any

from starlette.routing import Match

from agentbox.config import ServerConfig
from agentbox.server.body_memo import BodyMemo
from agentbox.server.errors import error_response

try:
    import orjson
except ImportError:  # then the stdlib path alone
    orjson = None  # type: ignore[assignment]

MAX_HEADER_BYTES = 64 * 1024
MAX_JSON_DEPTH = 64  # agent requests nest about 8 deep (a tool schema inside a tool inside the request)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
JSON_FIX = "-H 'Content-Type: application/json'"
PARSED_BODY = "agentbox.parsed_body"  # the scope key of the body as check_json decoded it (or None)
BODY_MEMO = BodyMemo()  # recent bodies, so a warm turn decodes only what it appended (body_memo.py)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_HOST = re.compile(r"(?:\[(?P<ip6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9.-]+))(?::(?P<port>[0-9]{1,5}))?")


def host_name(value: str) -> str | None:
    """`Host` without its port (`127.0.0.1:8000` -> 127.0.0.1, `[::1]:8000` -> ::1), or None when the value is not
    exactly a name or a bracketed IPv6 address with an optional numeric port."""
    m = _HOST.fullmatch(value.strip().lower())
    if m is None or (m["port"] is not None and int(m["port"]) > 65535):
        return None
    return m["ip6"] or m["name"]


def is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BadInput(ValueError):
    pass


def check_json(raw: bytes) -> Any:
    """Refuses a body too deep or with a lone surrogate; a body that is not JSON is left to the route,
    which names the parse error in its own shape.

    Fast path: orjson refuses every lone surrogate (escaped or raw) itself, so a body it reads needs only the
    depth walk over its containers, not a look at every string (the stdlib decode and that walk took 25-28 ms
    of a warm turn at 128k tokens, 0.63 MB). Anything orjson refuses takes the stdlib path below, which
    finds and words the fault as before. Returns orjson's decode when it passed (the route reuses it), else
    None.

    Faster still: a body that repeats a recent one's messages and appends (an agent's warm turn) reuses that
    decode and has only its new parts decoded and walked (0.8 ms -> 0.03 ms at 128k tokens, 0.13 ms when the
    remembered body has left the CPU's caches: comparing 0.6 MB), with the same result as orjson's decode of
    the whole; anything else about it and the whole body is decoded as before."""
    memo = BODY_MEMO
    hit = memo.lookup(raw) if type(raw) is bytes else None
    if hit is not None and all(_depth_ok(value, depth) for value, depth in hit.fresh):
        memo.keep(hit.seen, hit.base)
        return hit.body
    body = _orjson_body(raw)
    if body is not None and _depth_ok(body):
        if type(raw) is bytes and (seen := memo.index(raw, body)) is not None:
            memo.keep(seen)
        return body
    try:
        body = json.loads(raw)
    except RecursionError as e:
        raise BadInput("the request body is nested too deeply to read; flatten it") from e
    except ValueError:
        return
    stack: list[tuple[Any, int, str]] = [(body, 1, "body")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise BadInput(f"{where} holds a lone UTF-16 surrogate ({value[e.start:e.end]!a}); "
                                   "send valid Unicode text") from e
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise BadInput(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep (at {where}); "
                           "flatten it")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(k, str) and not k.isascii():
                stack.append((k, depth, f"a key in {where}"))
            stack.append((v, depth + 1, f"{where}.{k}" if isinstance(k, str) else f"{where}[{k}]"))


def _orjson_body(raw: bytes) -> Any:
    if orjson is None:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _depth_ok(body: Any, depth: int = 1) -> bool:
    """Whether no container in `body`, itself at `depth` (the request body is 1), nests deeper than
    MAX_JSON_DEPTH (strings were checked by the decoder). False sends the body down the full walk, which names
    where. orjson's decode holds exact dicts and lists, so an exact type test does: `isinstance(v, dict | list)` on each of a 128k-token body's ~10k values cost 1.8 ms
    a warm turn on this Xeon, the type test 0.9 ms."""
    containers = (dict, list)
    stack: list[tuple[Any, int]] = [(body, depth)] if type(body) in containers else []
    pop, push = stack.pop, stack.append
    while stack:
        value, depth = pop()
        if depth > MAX_JSON_DEPTH:
            return False
        for v in value.values() if type(value) is dict else value:
            if type(v) in containers:
                push((v, depth + 1))
    return True


class RequestGuard:
    def __init__(self, app: Any, config: ServerConfig) -> None:
        self.app = app
        self.loopback = is_loopback(config.host)
        self.allowed_hosts = LOOPBACK_NAMES | {config.host.strip("[]").lower()}
        self.max_body = int(config.max_body_mb * 2**20)
        self._post_paths: dict[str, bool] = {}  # path -> whether a route takes POST there

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers: list[tuple[bytes, bytes]] = scope["headers"]

        async def refuse(status: int, message: str, code: str) -> None:
            await error_response(path, status, message, code=code)(scope, receive, send)

        if sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES:
            await refuse(431, f"the request headers exceed {MAX_HEADER_BYTES // 1024} KiB", "headers_too_large")
            return
        h = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
        if sum(k == b"host" for k, _ in headers) > 1:
            await refuse(400, "the request has more than one Host header", "bad_host")
            return
        if self.loopback and "host" in h and host_name(h["host"]) not in self.allowed_hosts:
            await refuse(421, f"this server is bound to loopback and answers only to localhost, 127.0.0.1 or "
                         f"[::1] (with a numeric port), not to Host {h['host'][:100]!r} (a guard against DNS "
                         "rebinding). To serve other names: agentbox serve --host 0.0.0.0 with AGENTBOX_API_KEY "
                         "set", "bad_host")
            return
        if scope["method"] != "POST" or not self._posts_to_a_route(scope):
            await self.app(scope, receive, send)  # the router answers a wrong method with 405
            return
        ctype = h.get("content-type", "")
        if not is_json_type(ctype):
            said = f"Content-Type {ctype[:100]!r}" if ctype else "no Content-Type"
            await refuse(415, f"the request has {said}; the body must be JSON, sent with {JSON_FIX}",
                         "unsupported_media_type")
            return
        too_big = (f"the request body exceeds {self.max_body / 2**20:g} MiB; the server's limit is raised with "
                   "agentbox serve --max-body-mb N")
        declared = h.get("content-length", "0")
        if declared.isdigit() and int(declared) > self.max_body:
            await refuse(413, too_big, "body_too_large")
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                await refuse(413, too_big, "body_too_large")
                return
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            # The route's JSON decode (server/fast_json.py) takes this one instead of decoding again.
            scope[PARSED_BODY] = await asyncio.to_thread(check_json, body)
        except BadInput as e:
            await refuse(400, str(e), "invalid_value")
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, when it comes

        await self.app(scope, replay, send)

    def _posts_to_a_route(self, scope: dict) -> bool:
        """A route of the app (scope["app"], set by Starlette before its middleware runs) takes this POST."""
        path = scope["path"]
        known = self._post_paths.get(path)
        if known is None:
            app = scope.get("app")
            routes = getattr(getattr(app, "router", None), "routes", None)
            known = routes is None or any(getattr(r, "matches", None) is not None and r.matches(scope)[0] is Match.FULL
                                          for r in routes)
            if len(self._post_paths) < 1024:  # paths are the client's to choose: the memo stays bounded
                self._post_paths[path] = known
        return known
