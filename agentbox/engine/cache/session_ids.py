"""Which session a request belongs to, decided here and nowhere else.

In order: the id the client sent (the server reads it from the request: server/session_key.py, and scopes
it to the API key's namespace with `scoped`); else the session inferred from the cached prefix the request
matched (`SessionTable.infer_session`: the radix tree's tags, only among the namespace's own sessions); else a
fresh `<namespace>auto-N`, so that the request's later turns can be recognised by their prefix.
"""

from __future__ import annotations

import itertools

MAX_SESSION_ID_CHARS = 256  # an id is a key, not a payload: 1 MiB ids grew the session table by 91 MB
AUTO_PREFIX = "auto-"


def scoped(namespace: str, client_id: str | None) -> str | None:
    """The engine's id for a session the client named: its API key's namespace first ("" with one key)."""
    return namespace + client_id if client_id else None


class SessionIds:
    """The engine's half of the decision: a request that came without an id gets the inferred one, else a
    fresh one."""

    def __init__(self) -> None:
        self._auto = itertools.count()

    def decide(self, given: str | None, inferred: str | None, namespace: str) -> str:
        if given is not None:
            return given
        return inferred if inferred is not None else f"{namespace}{AUTO_PREFIX}{next(self._auto)}"
