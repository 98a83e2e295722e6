"""What the cache reports: its counters (`CacheStats`) and the views of a session the sessions endpoints
serve. Frozen dataclasses that cross the process boundary as they are; `engine.stats.to_json` makes the JSON
(field names are the keys /v1/stats, /v1/sessions and `agentbox top` read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from agentbox.config import CachePolicy
from agentbox.engine.cache.sessions import LeaseState, TurnRecord


@dataclass(frozen=True)
class CacheStats:
    policy: CachePolicy
    gpu_pages: int
    host_pages: int
    host_total_pages: int
    leased_pages: int
    evictions: int  # GPU pages dropped (not demoted)
    demotions: int  # GPU pages copied to host
    promotions: int  # host pages copied back to GPU
    host_evictions: int  # host pages dropped
    sessions: int
    live_leases: int
    # The disk tier (disk_tier.py); zeros without one.
    disk_pages: int = 0
    disk_bytes: int = 0
    disk_budget_bytes: int = 0
    disk_written: int = 0  # pages written (spilled, flushed or written behind)
    disk_restored: int = 0  # pages read back instead of recomputed
    disk_torn: int = 0  # chunks dropped: left torn by a crash or failing their checksum
    disk_sessions: int = 0  # sessions restored at start that have not returned yet ("on disk")
    disk_states: int = 0  # state snapshots on disk (models with per-sequence state: disk_states.py)
    disk_written_behind: int = 0  # pages queued at turn ends for the writer thread (radix_disk.py)
    disk_queued: int = 0  # writes queued for the writer thread, not done yet
    disk_dropped: int = 0  # queued writes dropped because the disk fell behind


class SessionState(Enum):
    GENERATING = "generating"  # a request of the session is in the engine
    WAITING_TOOL = "waiting_tool"  # none, but its lease is live: the agent is expected back
    IDLE = "idle"

@dataclass(frozen=True)
class SessionSummary:
    """A session's counters plus where its cache lives right now (/v1/sessions)."""

    id: str
    turns: int
    lease_state: LeaseState
    lease_expires_in_s: float | None
    prompt_tokens: int
    cached_tokens_gpu: int
    cached_tokens_host: int
    recomputed_history_tokens: int
    history_tokens: int
    last_ttft_s: float | None
    state: SessionState
    resident_pages_gpu: int
    resident_pages_host: int
    resident_tokens_gpu: int
    resident_tokens_host: int
    cached_tokens: int
    hit_rate: float | None
    last_turn_hit_rate: float | None
    recompute_ratio: float | None
    expected_gap_s: float | None
    snapshot_bytes: int  # hybrid models: the session's recurrent-state snapshots held now (0: none)
    on_disk_tokens: int = 0  # restored at start from the disk tier, not back yet (`agentbox top`: "on disk")
    # speculative decoding (engine/draft.py), filled by the core: draft tokens verified / accepted
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass(frozen=True)
class SessionList:
    data: list[SessionSummary]


@dataclass(frozen=True)
class SessionDetail(SessionSummary):
    """The summary plus the session's measured gaps and its recent turns (/v1/sessions/{id})."""

    gaps_s: list[float] = field(default_factory=list)
    turn_history: list[TurnRecord] = field(default_factory=list)


@dataclass(frozen=True)
class SessionDropped:
    id: str
    deleted: bool
    freed_pages: int
    aborted_requests: list[str]
