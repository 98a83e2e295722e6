"""What the sessions endpoints show of a session: its counters plus where its cache lives right now.
Every number comes from a counter or the tree, never from an estimate. The caller (the core) says which
sessions have a request in the engine; everything else comes from the cache's interface."""

from __future__ import annotations

from dataclasses import replace

from agentbox.engine.cache.page_cache import PageCache
from agentbox.engine.cache.radix_node import Tier
from agentbox.engine.cache.sessions import LeaseState, Session
from agentbox.engine.cache.stats import SessionDetail, SessionState, SessionSummary


def _state(s: Session, generating: bool, now: float) -> SessionState:
    if generating:
        return SessionState.GENERATING
    if s.lease_state(now) is LeaseState.LIVE:
        return SessionState.WAITING_TOOL
    return SessionState.IDLE


def session_summary(cache: PageCache, s: Session, generating: bool, snapshot_bytes: int = 0) -> SessionSummary:
    """`generating`: a request of the session is in the engine; `snapshot_bytes`: its recurrent-state
    snapshots held now (the snapshot store's count, which the core owns)."""
    now = cache.clock()
    pages = cache.session_pages(s.id)
    ps = cache.pool.page_size
    cached = s.cached_tokens_gpu + s.cached_tokens_host
    last = s.turn_history[-1] if s.turn_history else None
    return SessionSummary(
        id=s.id,
        turns=s.turns,
        lease_state=s.lease_state(now),
        lease_expires_in_s=None if s.lease_expiry is None else round(s.lease_expiry - now, 3),
        prompt_tokens=s.prompt_tokens,
        cached_tokens_gpu=s.cached_tokens_gpu,
        cached_tokens_host=s.cached_tokens_host,
        recomputed_history_tokens=s.recomputed_tokens,
        history_tokens=s.history_tokens,
        last_ttft_s=s.last_ttft_s,
        state=_state(s, generating, now),
        resident_pages_gpu=pages[Tier.GPU],
        resident_pages_host=pages[Tier.HOST],
        resident_tokens_gpu=pages[Tier.GPU] * ps,
        resident_tokens_host=pages[Tier.HOST] * ps,
        cached_tokens=cached,
        hit_rate=cached / s.prompt_tokens if s.prompt_tokens else None,
        last_turn_hit_rate=last.cached_tokens / last.prompt_tokens if last and last.prompt_tokens else None,
        recompute_ratio=s.recomputed_tokens / s.history_tokens if s.history_tokens else None,
        expected_gap_s=round(cache.sessions.expected_gap(s), 3) if s.gaps else None,
        snapshot_bytes=snapshot_bytes,
        on_disk_tokens=pages.get(Tier.DISK, 0) * ps,
    )


def session_detail(cache: PageCache, s: Session, generating: bool, snapshot_bytes: int = 0) -> SessionDetail:
    return SessionDetail(
        **vars(session_summary(cache, s, generating, snapshot_bytes)),
        gaps_s=[round(g, 3) for g in s.gaps],
        turn_history=[replace(t) for t in s.turn_history],
    )
