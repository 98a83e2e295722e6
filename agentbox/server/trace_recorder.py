"""Turn live traffic into a replayable trace (`agentbox serve --record-trace FILE`).

The server reports each finished request: its session key, the messages and tools it was sent, what the
model answered and when. A request whose messages extend the session's previous request is that session's
next turn: what it appends after the previous prompt and the echoed assistant message is the turn's
messages, and the assistant message as the client sent it back becomes the previous turn's recorded
output (so a replay rebuilds the client's prompts byte for byte). A request that does not extend the
previous one starts a new session under the same key (`key#2`, ...). Thread-safe; `save()` rewrites the
whole file atomically, so the server can call it after every turn or at shutdown.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox.trace import Message, Prefix, Session, Turn, content_text, save


@dataclass
class _Open:
    session: Session
    last_messages: list[Message]  # the previous request's messages
    last_finished: float
    generation: int = 1  # how many sessions this key has started


class TraceRecorder:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._sessions: dict[str, Session] = {}  # by id, in first-seen order

    def record(
        self,
        session_key: str,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        output: str,
        tool_calls: list[dict[str, Any]] | None,
        output_tokens: int,
        started: float,
        finished: float,
    ) -> None:
        """One finished request; `started`/`finished` on one monotonic clock (seconds)."""
        with self._lock:
            cur = self._open.get(session_key)
            turn = Turn(
                messages=[],
                output=output,
                output_tokens=max(1, output_tokens),
                wait_s=0.0,
                tool_calls=tool_calls or None,
            )
            if cur is not None and _extends(cur.last_messages, messages):
                n = len(cur.last_messages)
                prev = cur.session.turns[-1]
                echoed = messages[n] if len(messages) > n and messages[n].get("role") == "assistant" else None
                if echoed is not None:
                    prev.output = content_text(echoed.get("content"))
                    prev.tool_calls = echoed.get("tool_calls") or None
                    n += 1
                prev.wait_s = round(max(0.0, started - cur.last_finished), 3)
                turn.messages = list(messages[n:])
                cur.session.turns.append(turn)
                cur.last_messages, cur.last_finished = list(messages), finished
                return
            generation = cur.generation + 1 if cur is not None else 1
            sid = session_key if generation == 1 else f"{session_key}#{generation}"
            n_sys = 0
            while n_sys < len(messages) and messages[n_sys].get("role") == "system":
                n_sys += 1
            turn.messages = list(messages[n_sys:])
            session = Session(id=sid, prefix=Prefix(list(messages[:n_sys]), list(tools or [])), turns=[turn])
            self._open[session_key] = _Open(session, list(messages), finished, generation=generation)
            self._sessions[sid] = session

    def sessions(self) -> list[Session]:
        """A snapshot (deep copies: recording goes on while the caller reads)."""
        with self._lock:
            return [Session.from_json(s.to_json()) for s in self._sessions.values()]

    def save(self) -> None:
        sessions = self.sessions()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        save(sessions, tmp)
        os.replace(tmp, self.path)  # atomic: a reader never sees half a file


def _extends(previous: list[Message], messages: list[Message]) -> bool:
    return len(messages) > len(previous) and messages[: len(previous)] == previous
