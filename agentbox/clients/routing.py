"""The routing key a fleet's router can hash, for clients whose own session key it cannot see.

vllm-router (`agentbox fleet`) hashes the X-Session-Id and X-User-Id headers, a body `session_id` and
`metadata.user_id`. Claude Code's `metadata.user_id` carries its session: nothing to add. Codex's own
`session-id` header is not hashed (every turn landed on a random backend), and opencode and aider send no
key at all (every chat session hashed to the same backend). So setup and launch give those clients an
X-User-Id header: X-User-Id, not X-Session-Id, because agentbox itself takes X-Session-Id as the session and
would merge every conversation of a client into one; it ignores X-User-Id. A single server ignores it too.
"""

from __future__ import annotations

import getpass
import socket
import uuid

ROUTING_HEADER = "X-User-Id"


def routing_headers(per_launch: bool) -> dict[str, str]:
    """setup: one key per user and machine (a file serves every later run: that user's sessions share a
    backend); launch: one per run (runs spread over the backends)."""
    base = f"{getpass.getuser()}@{socket.gethostname()}"
    return {ROUTING_HEADER: f"{base}/{uuid.uuid4().hex[:12]}" if per_launch else base}
