"""What the sessions endpoints show of a session: its counters plus where its cache lives right now.
Every number comes from a counter or the tree, never from an estimate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentbox.engine.sessions import Session

if TYPE_CHECKING:
    from agentbox.engine.core import EngineCore


def _state(core: EngineCore, s: Session, now: float) -> str:
    reqs = [r for r in core.scheduler.requests.values() if r.session_id == s.id]
    if reqs:
        return "generating"
    if s.lease_state(now).value == "live":
        return "waiting_tool"
    return "idle"


def session_summary(core: EngineCore, s: Session) -> dict:
    now = core.cache.clock()
    pages = core.cache.session_pages(s.id)
    ps = core.pool.page_size
    cached = s.cached_tokens_gpu + s.cached_tokens_host
    last = s.turn_history[-1] if s.turn_history else None
    d = s.to_dict(now)
    d.pop("gaps_s", None)
    return {
        **d,
        "state": _state(core, s, now),
        "resident_pages_gpu": pages["gpu"],
        "resident_pages_host": pages["host"],
        "resident_tokens_gpu": pages["gpu"] * ps,
        "resident_tokens_host": pages["host"] * ps,
        "cached_tokens": cached,
        "hit_rate": cached / s.prompt_tokens if s.prompt_tokens else None,
        "last_turn_hit_rate": (last["cached_tokens"] / last["prompt_tokens"]) if last and last["prompt_tokens"] else None,
        "recompute_ratio": s.recomputed_tokens / s.history_tokens if s.history_tokens else None,
        "expected_gap_s": round(core.cache.sessions.expected_gap(s), 3) if s.gaps else None,
    }


def session_detail(core: EngineCore, s: Session) -> dict:
    return {
        **session_summary(core, s),
        "gaps_s": [round(g, 3) for g in s.gaps],
        "turn_history": list(s.turn_history),
    }
