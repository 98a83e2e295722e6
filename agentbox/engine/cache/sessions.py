"""Agent sessions: per-session counters and soft leases with a TTL learned from the session's own gaps
(which session a request belongs to is session_ids.py's).

A session is not a container of pages. It is a tag on radix-cache nodes (`RadixCache` tags every node on
the path a session matched or inserted) plus a lease: a promise, breakable under pressure, that its nodes
stay resident until `lease_expiry`. The TTL is learned: agent turns come back after a tool call, and each
session's own history of gaps (from the end of one turn to the start of the next) says how long to wait.
A high quantile of those gaps times a margin, clamped to [min_ttl_s, max_ttl_s]; `default_ttl_s` before the
first gap is seen. A hit or an insert refreshes the lease (expiry = now + TTL).

Lease states: `live` (expiry in the future), `expired` (granted, now past), `none` (never granted, or
released by the cap). The cap itself — leased pages at most `max_share` of the GPU pool — is enforced by
`RadixCache`, which knows the pages; it releases the oldest leases first through `release_lease`.

Time comes from an injectable `clock` (seconds, monotonic) so tests are deterministic.

The table is the data and its arithmetic (TTLs, expected gaps, live leases); its one writer is `Turns`
(turns.py), which the cache calls on a lock, an insert or a turn end, and the scheduler and the core reach
through the `CacheManager` (manager.py):
    lock = kv.lock(kv.match(tokens, sid))          # refreshes the lease on a hit; infers sid when None
    kv.begin_turn(sid, lock, namespace, tokens)    # decides the id; the turn starts; prompt counters
    kv.first_token(sid, ttft, record)              # time to first token, the turn's record
    kv.insert(tokens, pages, sid)                  # grants / refreshes the lease, enforces the cap
    kv.end_turn(sid)                               # turn done: gap clock starts, eviction keys refresh
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

from agentbox.config import EngineConfig
from agentbox.engine.cache.page_hash_memo import PageHashMemo
from agentbox.prefix import common_prefix

# How many recent gaps a session remembers: agents change pace (a long build, then quick edits).
GAP_HISTORY = 32
TURN_HISTORY = 64  # per-session turn records kept for `agentbox top`
TTL_QUANTILE = 0.9
TTL_MARGIN = 1.5
MIN_TTL_S = 2.0


class LeaseState(str, Enum):
    LIVE = "live"
    EXPIRED = "expired"
    NONE = "none"


def page_hashes(tokens: Sequence[int], page_size: int) -> list[int]:
    """A chained hash per full page: equal hashes at page i mean (almost surely) equal prefixes."""
    out: list[int] = []
    h = 0
    for i in range(len(tokens) // page_size):
        h = hash((h, tuple(tokens[i * page_size : (i + 1) * page_size])))
        out.append(h)
    return out


@dataclass
class TurnRecord:
    """One turn of a session, as `agentbox top` lists it."""

    turn: int
    prompt_tokens: int
    cached_tokens: int
    host_cached_tokens: int
    recomputed_tokens: int
    ttft_s: float
    completion_tokens: int = 0  # set when the turn's answer is complete


@dataclass
class Session:
    id: str
    created: float
    turns: int = 0
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=GAP_HISTORY))
    in_turn: bool = False
    last_turn_start: float | None = None
    last_turn_end: float | None = None
    last_active: float = 0.0
    lease_expiry: float | None = None  # None: no lease
    lease_granted: float | None = None  # when the current lease was first granted (the cap drops oldest)
    # Counters, from real events.
    prompt_tokens: int = 0
    cached_tokens_gpu: int = 0
    cached_tokens_host: int = 0
    recomputed_tokens: int = 0  # history this session had computed before that had to be computed again
    history_tokens: int = 0  # history tokens re-sent (what recomputed_tokens is a share of)
    turn_history: deque[TurnRecord] = field(default_factory=lambda: deque(maxlen=TURN_HISTORY))
    last_ttft_s: float | None = None
    # The page hashes of the last sequence inserted for this session: what "its history" is.
    history_hashes: list[int] = field(default_factory=list)
    last_prompt_tokens: int = 0  # the last prompt's length, page-floored
    last_sequence_tokens: int = 0  # the last inserted sequence (prompt + completion), page-floored

    def lease_state(self, now: float) -> LeaseState:
        if self.lease_expiry is None:
            return LeaseState.NONE
        return LeaseState.LIVE if self.lease_expiry > now else LeaseState.EXPIRED


def quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class SessionTable:
    def __init__(
        self,
        default_ttl_s: float = 10.0,
        max_ttl_s: float = 120.0,
        max_share: float = 0.8,
        clock: Callable[[], float] = time.monotonic,
        min_ttl_s: float = MIN_TTL_S,
    ) -> None:
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.min_ttl_s = min(min_ttl_s, max_ttl_s)
        self.max_share = max_share
        self.clock = clock
        self._sessions: dict[str, Session] = {}
        self._hashes = PageHashMemo()  # a turn hashes only its new pages (page_hash_memo.py)

    @classmethod
    def from_config(cls, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> SessionTable:
        return cls(config.lease_default_ttl_s, config.lease_max_ttl_s, config.lease_max_share, clock)

    # ---- lookup ----

    def get(self, sid: str) -> Session | None:
        return self._sessions.get(sid)

    def get_or_create(self, sid: str) -> Session:
        s = self._sessions.get(sid)
        if s is None:
            now = self.clock()
            s = self._sessions[sid] = Session(sid, created=now, last_active=now)
        return s

    def remove(self, sid: str) -> Session | None:
        self._hashes.forget(sid)
        return self._sessions.pop(sid, None)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, sid: object) -> bool:
        return sid in self._sessions

    # ---- turns and leases ----

    def ttl(self, s: Session) -> float:
        """A high quantile of the session's own gaps times a margin, clamped; the default before any gap."""
        if not s.gaps:
            return min(self.default_ttl_s, self.max_ttl_s)
        return min(max(quantile(list(s.gaps), TTL_QUANTILE) * TTL_MARGIN, self.min_ttl_s), self.max_ttl_s)

    def expected_gap(self, s: Session) -> float:
        """When the session is expected back after a turn ends: its median gap (half the TTL before any)."""
        return quantile(list(s.gaps), 0.5) if s.gaps else self.ttl(s) / 2

    def begin_turn(self, sid: str) -> Session:
        """A request of this session arrived: count the turn, measure the gap since the last turn ended."""
        s = self.get_or_create(sid)
        now = self.clock()
        if not s.in_turn and s.last_turn_end is not None:
            s.gaps.append(max(0.0, now - s.last_turn_end))
        s.in_turn = True
        s.turns += 1
        s.last_turn_start = now
        s.last_active = now
        return s

    def end_turn(self, sid: str) -> Session:
        """The turn's response is done: the gap clock starts and the lease runs for a fresh TTL."""
        s = self.get_or_create(sid)
        now = self.clock()
        s.in_turn = False
        s.last_turn_end = now
        s.last_active = now
        self.refresh(sid)
        return s

    def refresh(self, sid: str) -> float:
        """Grant or extend the lease (a hit, an insert, a turn end). Returns the new expiry."""
        s = self.get_or_create(sid)
        now = self.clock()
        if s.lease_state(now) is not LeaseState.LIVE:
            s.lease_granted = now
        s.lease_expiry = now + self.ttl(s)
        s.last_active = now
        return s.lease_expiry

    def release_lease(self, sid: str) -> None:
        """Break the lease (the cap, or a drop): the session's nodes become ordinary LRU entries."""
        s = self._sessions.get(sid)
        if s is not None:
            s.lease_expiry = None
            s.lease_granted = None

    def lease_state(self, sid: str) -> LeaseState:
        s = self._sessions.get(sid)
        return LeaseState.NONE if s is None else s.lease_state(self.clock())

    def live(self) -> list[Session]:
        now = self.clock()
        return [s for s in self._sessions.values() if s.lease_state(now) is LeaseState.LIVE]

    # ---- counters ----

    def record_prompt(
        self, sid: str, tokens: Sequence[int], cached_tokens: int, host_tokens: int, page_size: int
    ) -> int:
        """Count one request's prompt; returns its recomputed history tokens: page-aligned tokens of this
        session's previous sequence that the prompt repeats but the cache no longer had."""
        s = self.get_or_create(sid)
        s.prompt_tokens += len(tokens)
        s.cached_tokens_gpu += cached_tokens - host_tokens
        s.cached_tokens_host += host_tokens
        s.last_prompt_tokens = len(tokens) // page_size * page_size
        common = common_prefix(self._hashes.hashes(sid, tokens, page_size), s.history_hashes)
        recomputed = max(0, common * page_size - cached_tokens)
        s.recomputed_tokens += recomputed
        s.history_tokens += common * page_size
        return recomputed

    def record_history(self, sid: str, tokens: Sequence[int], page_size: int) -> None:
        """The session computed `tokens`: they are its history now, unless they are a prefix of the history it
        has (the computed part of a preempted or aborted request): that must not shrink it, or the next
        turn's recompute would go uncounted."""
        s = self.get_or_create(sid)
        hashes = self._hashes.hashes(sid, tokens, page_size)
        old = s.history_hashes
        if len(hashes) <= len(old) and (not hashes or old[len(hashes) - 1] == hashes[-1]):
            return
        s.history_hashes = hashes
        s.last_sequence_tokens = len(hashes) * page_size

    def record_ttft(self, sid: str, seconds: float) -> None:
        self.get_or_create(sid).last_ttft_s = seconds


def sessions_by_lease_age(sessions: Iterable[Session]) -> list[Session]:
    """Oldest lease first: the order in which the cap breaks leases."""
    return sorted(sessions, key=lambda s: (s.lease_granted or 0.0, s.id))
