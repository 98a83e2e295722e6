"""The one writer of the session table: a turn's lifecycle (it begins, its prompt is counted, its first token
is timed, its answer completes, it ends) and a session's lease (granted, refreshed, broken, forgotten).

The table (sessions.py) holds the data and answers questions about it (TTLs, live leases, inference);
every change to it goes through here, so a counter or a lease has one place that moves it. The scheduler and
the core reach these through the `CacheManager` (manager.py), which adds what the cache must do at the same
moment (a turn end re-keys the session's pages for eviction); the radix tree's session index calls the
lease half when a lock or an insert touches a session's path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agentbox.engine.cache.sessions import Session, SessionTable, TurnRecord


class Turns:
    def __init__(self, table: SessionTable) -> None:
        self.table = table

    @property
    def clock(self) -> Callable[[], float]:
        return self.table.clock

    # ---- a turn ----

    def begin(self, sid: str, prompt: Sequence[int], cached_tokens: int, host_tokens: int, page_size: int) -> int:
        """A request of `sid` was admitted for the first time: the turn starts (the gap since the last one is
        measured) and its prompt is counted. Returns its recomputed history tokens."""
        self.table.begin_turn(sid)
        return self.table.record_prompt(sid, prompt, cached_tokens, host_tokens, page_size)

    def first_token(self, sid: str, ttft_s: float, record: TurnRecord) -> None:
        """The turn's first token is out: its time to first token and its record (turn number filled in)."""
        self.table.record_ttft(sid, ttft_s)
        s = self.table.get(sid)
        if s is not None:
            record.turn = s.turns
            s.turn_history.append(record)

    def complete(self, sid: str, completion_tokens: int) -> None:
        """The turn's answer is complete: its record gets the answer's length."""
        s = self.table.get(sid)
        if s is not None and s.turn_history:
            s.turn_history[-1].completion_tokens = completion_tokens

    def end(self, sid: str) -> None:
        """The turn is done (its pages are back in the cache): the gap clock starts, the lease runs a fresh TTL."""
        self.table.end_turn(sid)

    def history(self, sid: str, tokens: Sequence[int], page_size: int) -> None:
        """The session computed `tokens` (what its next turn's recompute is measured against)."""
        self.table.record_history(sid, tokens, page_size)

    # ---- a lease ----

    def ensure(self, sid: str) -> Session:
        return self.table.get_or_create(sid)

    def refresh(self, sid: str) -> float:
        """Grant or extend the lease; returns its expiry."""
        return self.table.refresh(sid)

    def release_lease(self, sid: str) -> None:
        self.table.release_lease(sid)

    def restore(self, sid: str, fields: dict[str, object], gaps: Sequence[float]) -> Session:
        """A session saved at the last stop (disk_sessions.py) comes back under its id, without a lease."""
        s = self.table.get_or_create(sid)
        for name, value in fields.items():
            setattr(s, name, value)
        s.gaps.extend(gaps)
        return s

    def forget(self, sid: str) -> None:
        self.table.remove(sid)
