"""The radix cache under random traffic: a hypothesis state machine over a small GPU pool and host tier.

Requests look up, then lock: a lookup (kept or dropped) changes nothing, an admission that does not fit
changes nothing, a lookup the tree has changed under is refused, and `reclaimable` is exactly what eviction
frees once the match is locked."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from radix_harness import Req, check_lock, finish, make_cache, snapshot, start

from agentbox.engine.cache.radix_cache import Tier
from agentbox.engine.cache.radix_node import Match


class CacheMachine(RuleBasedStateMachine):
    """Random traffic over a small GPU pool and host tier; integrity and no leaks after every step."""

    @initialize(
        page_size=st.integers(2, 4),
        gpu_pages=st.integers(4, 20),
        host_pages=st.sampled_from([0, 3, 8, 16, 16]),
        policy=st.sampled_from(["session", "session", "session", "lru", "none"]),
        max_share=st.sampled_from([0.3, 0.8, 1.0]),
    )
    def setup(self, page_size: int, gpu_pages: int, host_pages: int, policy: str, max_share: float) -> None:
        self.cache, self.clock = make_cache(gpu_pages, page_size, host_pages, policy, max_share)
        self.running: list[Req] = []
        self.pending: list[tuple[Match, list[int]]] = []  # lookups kept for later (most go stale)

    tokens = st.lists(st.integers(0, 2), min_size=0, max_size=16)
    sessions = st.sampled_from([None, "a", "b", "c"])

    @rule(tokens=tokens, session=sessions)
    def start(self, tokens: list[int], session: str | None) -> None:
        if session is not None:
            self.cache.sessions.begin_turn(session)
        before = snapshot(self.cache)
        req = start(self.cache, tokens, session)
        if req is not None:
            self.running.append(req)
        else:
            assert snapshot(self.cache) == before, "an admission that did not fit changed the cache"

    @rule(tokens=tokens, session=sessions, keep=st.booleans())
    def lookup(self, tokens: list[int], session: str | None, keep: bool) -> None:
        before = snapshot(self.cache)
        m = self.cache.match(tokens, session)
        r = self.cache.reclaimable(m)
        assert snapshot(self.cache) == before, "a lookup changed the cache"
        assert m == self.cache.match(tokens, session) and r == self.cache.reclaimable(m)
        assert m.num_tokens <= len(tokens) and m.num_tokens % self.cache.ps == 0
        if keep:
            self.pending.append((m, tokens))

    @precondition(lambda self: self.pending)
    @rule()
    def lock_pending(self) -> None:
        m, tokens = self.pending.pop()
        if m.epoch != self.cache._epoch:
            with pytest.raises(ValueError, match="stale"):
                self.cache.lock(m)
            return
        lock = self.cache.lock(m)
        check_lock(self.cache, tokens, lock)
        self.running.append(Req(tokens[: lock.num_tokens], lock.session, lock.pages))

    @rule(tokens=tokens, session=sessions)
    def reclaim(self, tokens: list[int], session: str | None) -> None:
        """reclaimable(m) is exact: after locking m, evicting everything frees that many pages, less those
        the lock took to promote m's host part."""
        m = self.cache.match(tokens, session)
        r = self.cache.reclaimable(m)
        lock = self.cache.lock(m)
        check_lock(self.cache, tokens, lock)
        self.running.append(Req(tokens[: lock.num_tokens], lock.session, lock.pages))
        promoted = len(lock.pages) - m.num_resident_tokens // self.cache.ps
        self.cache.evict(10**6)
        assert self.cache.pool.num_free == r - promoted

    @rule(tokens=tokens, session=sessions)
    def turn(self, tokens: list[int], session: str | None) -> None:
        if session is not None:
            self.cache.sessions.begin_turn(session)
        req = start(self.cache, tokens, session)
        if req is not None:
            finish(self.cache, req)

    @rule(tokens=tokens, session=sessions)
    def lock(self, tokens: list[int], session: str | None) -> None:
        lock = self.cache.lock(self.cache.match(tokens, session))  # a request waiting with its prefix held
        check_lock(self.cache, tokens, lock)
        self.running.append(Req(tokens[: lock.num_tokens], lock.session, lock.pages))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        finish(self.cache, self.running.pop(i % len(self.running)))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        self.cache.release(self.running.pop(i % len(self.running)).pages)

    @rule(n=st.integers(1, 8))
    def evict(self, n: int) -> None:
        free = self.cache.pool.num_free
        freed = self.cache.evict(n)
        assert self.cache.pool.num_free == free + freed

    @rule(n=st.integers(1, 8))
    def demote(self, n: int) -> None:
        self.cache.demote(n)

    @rule(session=st.sampled_from(["a", "b", "c"]))
    def drop_session(self, session: str) -> None:
        self.cache.drop_session(session)

    @rule(dt=st.sampled_from([0.5, 3.0, 30.0]))
    def tick(self, dt: float) -> None:
        self.clock.t += dt

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        refs = Counter(p for r in self.running for p in r.pages)
        self.cache.check_integrity(refs)
        held = len(set(refs))
        assert self.cache.pool.num_free + len(set(refs) | self._owned()) == self.cache.pool.capacity
        assert held <= self.cache.pool.num_used

    def _owned(self) -> set[int]:
        out: set[int] = set()
        stack = list(self.cache.root.children.values())
        while stack:
            n = stack.pop()
            if n.tier is Tier.GPU:
                out.update(n.pages)
            stack.extend(n.children.values())
        return out

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for r in self.running:
            self.cache.release(r.pages)
        self.running.clear()
        self.cache.evict(10**6)
        if self.cache.host is not None:
            self.cache.evict_host(10**6)
        assert self.cache.pool.num_free == self.cache.pool.capacity  # nothing leaked
        assert self.cache.host is None or self.cache.host.pool.num_free == self.cache.host.pool.capacity
        self.cache.check_integrity(Counter())


CacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCacheMachine = CacheMachine.TestCase
