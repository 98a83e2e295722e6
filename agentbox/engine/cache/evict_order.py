"""The order in which the session policy gives GPU pages up: a heap key per leaf node (radix_evict.py's
docstring has the three classes). Pure functions of a node, the session table and the clock; the other
policies order by last access alone (RadixCache.eviction_key)."""

from __future__ import annotations

from agentbox.engine.cache.radix_node import Node
from agentbox.engine.cache.sessions import LeaseState, Session, SessionTable

ATTN_TOKENS = 4096.0  # depth at which attention's share of a token's recompute cost equals the MLPs'
MIN_WAIT_S = 0.05  # an overdue session is "about to return": its saving rate is capped, not infinite


def gpu_key(n: Node, sessions: SessionTable, now: float) -> tuple[int, float]:
    """(class, key), smallest first out: 0 unleased by last access, 1 expired by expiry, 2 live by the
    expected saving per page-second."""
    best = (0, n.last_access)
    for sid in n.sessions:
        s = sessions.get(sid)
        if s is None:
            continue
        state = s.lease_state(now)
        if state is LeaseState.LIVE:
            key = (2, saving_rate(n, s, sessions, now))
        elif state is LeaseState.EXPIRED:
            assert s.lease_expiry is not None
            key = (1, s.lease_expiry)
        else:
            continue
        best = max(best, key)
    return best


def saving_rate(n: Node, s: Session, sessions: SessionTable, now: float) -> float:
    """Recompute cost of the node's tokens (attention grows with depth) per page, per second until the
    session is expected back."""
    tokens = len(n.key)
    cost = tokens * (1.0 + (n.start + tokens / 2) / ATTN_TOKENS)
    back = (s.last_turn_end if s.last_turn_end is not None else s.last_active) + sessions.expected_gap(s)
    return cost / (len(n.pages) * max(back - now, MIN_WAIT_S))
