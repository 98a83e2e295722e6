"""The session id the client sent, read from its request: the first step of the one decision of a request's
session, which engine/cache/session_ids.py writes down whole (the client's id scoped to its API key's
namespace; else inferred from the cached prefix; else a fresh `auto-N`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from agentbox.engine.cache.session_ids import MAX_SESSION_ID_CHARS
from agentbox.server.errors import APIError

_CLAUDE_USER_ID = re.compile(r"_session_([0-9a-fA-F-]{8,})")


def session_key(headers: Mapping[str, str], body: dict[str, Any] | BaseModel) -> str | None:
    """The request's session id (see `_session_key`); one longer than MAX_SESSION_ID_CHARS is a 400."""
    sid = _session_key(headers, body if isinstance(body, dict) else session_fields(body))
    if sid is not None and len(sid) > MAX_SESSION_ID_CHARS:
        raise APIError(400, f"the session id is {len(sid)} characters long; at most {MAX_SESSION_ID_CHARS} are "
                       "accepted (X-Session-Id, session_id or metadata.user_id)", param="session_id",
                       code="invalid_value")
    return sid


def session_fields(body: BaseModel) -> dict[str, Any]:
    """The two body fields a session id is read from, as plain values: a declared field or an extra one. Not
    `model_dump()`, which copied the whole conversation (5-13 ms a turn at 128k tokens) to read two fields."""
    out: dict[str, Any] = {}
    for name in ("session_id", "metadata"):
        v = getattr(body, name, None)
        if v is None and body.model_extra:
            v = body.model_extra.get(name)
        out[name] = v.model_dump() if isinstance(v, BaseModel) else v
    return out


def _session_key(headers: Mapping[str, str], body: dict[str, Any]) -> str | None:
    """Order: X-Session-Id header, `session_id` body field, X-Claude-Code-Session-Id header, Codex's
    `session-id` header, Anthropic `metadata.user_id` (the `..._session_<uuid>` string, or a JSON string
    carrying `session_id`)."""
    if v := headers.get("x-session-id"):
        return v
    if isinstance(v := body.get("session_id"), str) and v:
        return v
    if v := headers.get("x-claude-code-session-id"):
        return v
    if v := headers.get("session-id") or headers.get("session_id"):
        return v
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(uid := meta.get("user_id"), str) and uid:
        if m := _CLAUDE_USER_ID.search(uid):
            return m.group(1)
        try:
            parsed = json.loads(uid)
        except ValueError:
            return None
        if isinstance(parsed, dict) and isinstance(sid := parsed.get("session_id"), str) and sid:
            return sid
    return None
