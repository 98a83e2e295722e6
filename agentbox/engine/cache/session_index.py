"""The radix cache's per-session view: which nodes each session's sequences pass through, when each
session's lease runs out, and the cap on leased GPU pages. The session table (sessions.py) owns the sessions
themselves (and `Turns` writes it); this is only what the tree needs to know about them."""

from __future__ import annotations

import heapq

from agentbox.engine.cache.radix_node import Node, Tier
from agentbox.engine.cache.sessions import Session, sessions_by_lease_age
from agentbox.engine.cache.turns import Turns


class SessionIndex:
    def __init__(self, turns: Turns) -> None:
        self.turns = turns
        self.sessions = turns.table  # read only: changes go through turns
        self.nodes: dict[str, set[Node]] = {}  # session -> the nodes tagged with it
        self._expiries: list[tuple[float, str]] = []  # (lease expiry, session); stale entries die lazily

    # ---- tags ----

    def tag(self, path: list[Node], sid: str) -> None:
        self.turns.ensure(sid)
        nodes = self.nodes.setdefault(sid, set())
        for n in path:
            n.sessions.add(sid)
            nodes.add(n)

    def of(self, sid: str) -> set[Node]:
        return self.nodes.get(sid, set())

    def split(self, pre: Node) -> None:
        """A node was cut in two: its new prefix node carries the same sessions."""
        for sid in pre.sessions:
            self.nodes[sid].add(pre)

    def removed(self, n: Node) -> None:
        for sid in n.sessions:
            self.nodes[sid].discard(n)

    def forget(self, sid: str) -> set[Node]:
        """Untag the session everywhere; returns the nodes it was on."""
        nodes = self.nodes.pop(sid, set())
        for n in nodes:
            n.sessions.discard(sid)
        self.turns.forget(sid)
        return nodes

    def pages_by_tier(self, sid: str) -> dict[Tier, int]:
        """Resident pages on each tier of the nodes this session's sequences pass through (shared ones too)."""
        out = {Tier.GPU: 0, Tier.HOST: 0}
        for n in self.of(sid):
            out[n.tier] += len(n.pages)
        return out

    # ---- lease expiry ----

    def refreshed(self, sid: str) -> None:
        """Grant or extend the session's lease and remember when it runs out."""
        heapq.heappush(self._expiries, (self.turns.refresh(sid), sid))
        if len(self._expiries) > 4 * len(self.sessions) + 64:
            current = {(s.lease_expiry, s.id) for s in self.sessions if s.lease_expiry is not None}
            self._expiries = [e for e in self._expiries if e in current]
            heapq.heapify(self._expiries)

    def expired(self, now: float) -> list[str]:
        """Sessions whose lease ran out since the last call (their leaves drop from class 2 to 1)."""
        out: list[str] = []
        while self._expiries and self._expiries[0][0] <= now:
            expiry, sid = heapq.heappop(self._expiries)
            s = self.sessions.get(sid)
            if s is not None and s.lease_expiry == expiry:
                out.append(sid)
        return out

    def num_expiry_entries(self) -> int:
        return len(self._expiries)

    # ---- the lease cap ----

    def _leased(self, live: list[Session]) -> tuple[dict[Node, int], int]:
        """How many of the live leases hold each GPU node, and the GPU pages they hold in all."""
        count: dict[Node, int] = {}
        total = 0
        for s in live:
            for n in self.of(s.id):
                if n.tier is Tier.GPU:
                    c = count.get(n, 0)
                    if c == 0:
                        total += len(n.pages)
                    count[n] = c + 1
        return count, total

    def leased_pages(self, live: list[Session]) -> int:
        """GPU pages the leases of `live` hold (the policy says which leases hold pages)."""
        return self._leased(live)[1]

    def release_over_cap(self, live: list[Session], pool_capacity: int) -> list[str]:
        """Leased GPU pages at most max_share of the pool: break the oldest of `live`'s leases first. Returns
        the sessions whose lease was broken (their leaves' eviction keys must move)."""
        count, total = self._leased(live)
        cap = self.sessions.max_share * pool_capacity
        broken: list[str] = []
        for s in sessions_by_lease_age(live):
            if total <= cap:
                break
            self.turns.release_lease(s.id)
            broken.append(s.id)
            for n in self.of(s.id):
                if n in count:
                    count[n] -= 1
                    if count[n] == 0:
                        total -= len(n.pages)
        return broken
