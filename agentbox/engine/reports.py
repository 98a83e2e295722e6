"""What the engine core reports, from its real counters: `/v1/stats` (EngineStats) and the answers to the
session queries (list, one session, drop). Apart from core.py, which admits requests and runs steps."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Protocol, TypeVar

from agentbox.engine.cache.manager import CacheManager
from agentbox.engine.cache.stats import SessionDetail, SessionDropped, SessionList, SessionSummary
from agentbox.engine.draft import Drafter
from agentbox.engine.exec.runner import ModelRunner
from agentbox.engine.exec.worker import TPWorkers
from agentbox.engine.ipc.messages import Query, QueryFailed, QueryKind, QueryResult
from agentbox.engine.scheduler import Scheduler
from agentbox.engine.stats import (
    AdmissionStats,
    DrafterStats,
    EngineCounters,
    EngineStats,
    ExpertStats,
    ParallelStats,
    PoolStats,
    SessionCounts,
    SpecStats,
)
from agentbox.layers.experts.placement import ExpertHome
from agentbox.models.loader import expert_kernels


class EngineCore(Protocol):
    """What the reports read of the engine core (engine/core.py), and the two things they ask of it."""

    started: float
    scheduler: Scheduler
    cache: CacheManager
    runner: ModelRunner
    counters: EngineCounters
    drafter: Drafter | None
    workers: TPWorkers | None

    def prune_sessions(self, room: int = 0) -> int: ...

    def busy_sessions(self) -> set[str | None]: ...


_Summary = TypeVar("_Summary", SessionSummary, SessionDetail)


def engine_stats(core: EngineCore) -> EngineStats:
    sch = core.scheduler
    return EngineStats(
        uptime_s=time.time() - core.started,
        running=len(sch.running),
        waiting=sch.num_waiting(),
        pool=PoolStats(
            total_pages=core.cache.capacity,
            free_pages=core.cache.num_free,
            used_pages=core.cache.capacity - core.cache.num_free,
            page_size=core.cache.page_size,
            running_pages=core.cache.running_pages(sch.handles()),
            page_bytes=core.runner.kv_cache.page_bytes,
            kv_bytes_per_token=core.runner.kv_cache.page_bytes // core.cache.page_size,
        ),
        cache=core.cache.stats(),
        counters=replace(core.counters),
        admission=AdmissionStats(
            queued_new_sessions=len(sch.waiting_new),
            timeouts=sch.admission_timeouts,
            rejections=sch.admission_rejections,
        ),
        sessions=SessionCounts(count=len(core.cache.sessions), live_leases=len(core.cache.sessions.live())),
        parallel=_parallel_stats(core),
        snapshots=core.cache.snapshot_stats(),
        speculative=_spec_stats(core),
        experts=_expert_stats(core),
    )


def _expert_stats(core: EngineCore) -> ExpertStats:
    r = core.runner
    placement = r.placement
    if placement is None or not placement.homes:
        return ExpertStats()
    host = [m for m, home in zip(expert_kernels(r.loaded.model), placement.homes, strict=True)
            if home is ExpertHome.HOST]
    t = r.expert_times
    return ExpertStats(
        moe_layers=len(placement.homes), host_layers=placement.num_host, host_bytes=r.host_expert_bytes,
        device=r.device.type, host_method=", ".join(sorted(set(host))), steps=t.steps,
        cpu_expert_ms_per_step=round(1e3 * t.cpu_expert_s / t.steps, 3) if t.steps else 0.0,
        cpu_expert_share=round(t.cpu_expert_s / t.step_s, 4) if t.step_s else 0.0,
        last_step_ms=round(1e3 * t.last_step_s, 3), last_cpu_expert_ms=round(1e3 * t.last_cpu_expert_s, 3),
    )


def _spec_stats(core: EngineCore) -> SpecStats:
    c = core.counters
    return SpecStats(
        mode=core.drafter.describe() if core.drafter is not None else "off",
        drafted_tokens=c.drafted_tokens, accepted_tokens=c.accepted_tokens,
        acceptance_rate=round(c.accepted_tokens / c.drafted_tokens, 4) if c.drafted_tokens else 0.0,
        drafters={} if core.drafter is None else {
            src.value: DrafterStats(steps, drafted, accepted, round(accepted / steps, 4) if steps else 0.0)
            for src, (steps, drafted, accepted) in core.drafter.by_source.items()},
    )


def _spec_counts(core: EngineCore, summary: _Summary) -> _Summary:
    counts = None if core.drafter is None else core.drafter.by_session.get(summary.id)
    if counts is None:
        return summary
    return replace(summary, spec_drafted_tokens=counts[0], spec_accepted_tokens=counts[1])


def _parallel_stats(core: EngineCore) -> ParallelStats:
    w = core.workers
    return ParallelStats(
        tensor_parallel_size=core.runner.tp,
        weight_bytes_per_rank=list(core.runner.weight_bytes_per_rank),
        step_send_us=round(1e6 * w.send_seconds / w.steps_sent, 1) if w is not None and w.steps_sent else None,
    )


def answer_query(core: EngineCore, q: Query) -> QueryResult:
    if q.kind is QueryKind.STATS:
        return engine_stats(core)
    if q.kind is QueryKind.SESSIONS:
        core.prune_sessions()
        busy = core.busy_sessions()
        return SessionList([_spec_counts(core, core.cache.session_summary(s, s.id in busy))
                            for s in core.cache.sessions])
    if q.kind is QueryKind.SESSION:
        s = core.cache.sessions.get(q.arg or "")
        if s is None:
            return None
        return _spec_counts(core, core.cache.session_detail(s, s.id in core.busy_sessions()))
    if q.kind is QueryKind.DROP_SESSION:
        sid = q.arg or ""
        if sid not in core.cache.sessions:
            return None
        active = [r for r in core.scheduler.requests.values() if r.session_id == sid]
        for r in active:
            core.scheduler.finish(r, "abort")
        freed = core.cache.forget_session(sid)
        return SessionDropped(id=sid, deleted=True, freed_pages=freed, aborted_requests=[r.request_id for r in active])
    return QueryFailed(f"unknown query {q.kind!r}")
