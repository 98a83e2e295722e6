"""Which session a request belongs to, decided here and nowhere else.

In order: the id the client sent (the server reads it from the request, server/session_key.py, and prefixes
its API key's namespace, server/generation.py); else the session inferred from where the request's cached
prefix ends (`lookup`, which the cache's pure `match` reports); else, at the request's first admission, a
fresh `<namespace>auto-N` (`decide`), so that its later turns can be recognised by their prefix.
"""

from __future__ import annotations

import itertools

from agentbox.engine.cache.radix_node import Node
from agentbox.engine.cache.sessions import Session, SessionTable

MAX_SESSION_ID_CHARS = 256  # an id is a key, not a payload: 1 MiB ids grew the session table by 91 MB
AUTO_PREFIX = "auto-"


class SessionIds:
    def __init__(self, table: SessionTable) -> None:
        self.table = table  # read only
        self._auto = itertools.count()

    def lookup(self, given: str | None, match_node: Node | None, matched_tokens: int, namespace: str) -> str | None:
        """The given session, else the one inferred from the matched path's end (None: a new one). Pure."""
        return given if given is not None else self._infer(match_node, matched_tokens, namespace)

    def decide(self, found: str | None, namespace: str) -> str:
        """At a request's first admission: what `lookup` found, else a fresh id."""
        return found if found is not None else f"{namespace}{AUTO_PREFIX}{next(self._auto)}"

    def _infer(self, match_node: Node | None, matched_tokens: int, namespace: str) -> str | None:
        """The session a keyless request belongs to, from where its cached prefix ends.

        The deepest tagged node on the matched path names the candidates: sessions whose sequences pass
        through it. A candidate qualifies only if the match reaches at least its last sequence (page-floored):
        an agent's next turn re-sends its whole transcript, while a new conversation that merely shares a
        system prompt ends its match inside that prompt. Among qualifiers the most recently active wins.
        """
        node = match_node
        while node is not None and not any(s.startswith(namespace) for s in node.sessions):
            node = node.parent
        if node is None:
            return None
        best: Session | None = None
        for sid in node.sessions:
            if not sid.startswith(namespace):
                continue  # another API key's session: never joined, whatever the prefix
            s = self.table.get(sid)
            # The match must cover the session's whole last sequence (prompt and answer): a new conversation
            # that shares only a system prompt with a short earlier one must not be folded into it.
            if s is None or max(s.last_prompt_tokens, s.last_sequence_tokens) > matched_tokens:
                continue
            if best is None or s.last_active > best.last_active:
                best = s
        return None if best is None else best.id
