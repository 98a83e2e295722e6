"""Typed messages between the API process and the engine core process. Small, picklable, nothing else.

The engine's counters and its views of the cache and the sessions cross the boundary as the dataclasses
below (never as string-keyed dicts); the API process turns them into the JSON it serves with `to_json`,
whose shape /v1/stats, /metrics, /v1/sessions and `agentbox top` read: field names are the JSON keys.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from agentbox.config import CachePolicy
from agentbox.engine.cache.sessions import LeaseState
from agentbox.engine.sampling import SamplingParams


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    session_id: str | None = None
    # The API key's namespace ("" without several keys): sessions are inferred only among its own, and the
    # cached tokens reported count only prefixes its own sessions computed.
    namespace: str = ""


@dataclass
class AbortRequest:
    request_id: str


class QueryKind(Enum):
    STATS = "stats"  # -> EngineStats
    SESSIONS = "sessions"  # -> SessionList
    SESSION = "session"  # arg: session id -> SessionDetail, or None when unknown
    DROP_SESSION = "drop_session"  # arg: session id -> SessionDropped, or None when unknown


@dataclass
class Query:
    """A read (or a session drop) answered between steps."""

    query_id: int
    kind: QueryKind
    arg: str | None = None


@dataclass
class Shutdown:
    pass


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    num_recomputed_tokens: int = 0
    session_id: str | None = None
    error: str | None = None
    error_code: str | None = None  # queue_full | admission_timeout -> 429; prompt_too_long -> 400


@dataclass
class StepOutputs:
    outputs: list[RequestOutput]


# ---- what queries answer ----


@dataclass
class EngineCounters:
    """The engine's running totals since start, from real events."""

    requests: int = 0
    prompt_tokens: int = 0  # of requests that reached their first token
    cached_tokens: int = 0  # of those, served from the cache (all tiers)
    host_cached_tokens: int = 0  # of those, copied back from the host tier
    recomputed_history_tokens: int = 0  # session history the cache had dropped and was computed again
    generated_tokens: int = 0
    computed_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    request_failures: int = 0  # requests ended by their own exception (the engine kept serving)


@dataclass(frozen=True)
class PoolStats:
    total_pages: int
    free_pages: int
    used_pages: int
    page_size: int
    running_pages: int


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


@dataclass(frozen=True)
class AdmissionStats:
    queued_new_sessions: int
    timeouts: int
    rejections: int


@dataclass(frozen=True)
class SessionCounts:
    count: int
    live_leases: int


@dataclass(frozen=True)
class ParallelStats:
    tensor_parallel_size: int = 1
    weight_bytes_per_rank: list[int] = field(default_factory=list)  # resident parameter bytes, rank order
    step_send_us: float | None = None  # rank 0's mean time to send a step to the workers; None: no workers


@dataclass(frozen=True)
class EngineStats:
    uptime_s: float
    running: int
    waiting: int
    pool: PoolStats
    cache: CacheStats
    counters: EngineCounters
    admission: AdmissionStats
    sessions: SessionCounts
    parallel: ParallelStats


class SessionState(Enum):
    GENERATING = "generating"  # a request of the session is in the engine
    WAITING_TOOL = "waiting_tool"  # none, but its lease is live: the agent is expected back
    IDLE = "idle"


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


@dataclass(frozen=True)
class QueryFailed:
    error: str


QueryResult = EngineStats | SessionList | SessionDetail | SessionDropped | QueryFailed | None


@dataclass
class QueryReply:
    query_id: int
    result: QueryResult


def to_json(msg: Any) -> dict[str, Any]:
    """A query result as the plain JSON the HTTP API serves: field names as keys, enums by value."""
    return asdict(msg, dict_factory=lambda items: {k: v.value if isinstance(v, Enum) else v for k, v in items})


@dataclass
class EngineReady:
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_pages: int
    page_size: int
    attention_backend: str
    device: str
    dtype: str
    tensor_parallel_size: int = 1
    weight_bytes_per_rank: list[int] = field(default_factory=list)  # resident parameter bytes, rank order


@dataclass
class EngineFailed:
    """The engine could not start, or a tensor-parallel rank died (dead_rank) and the engine exited."""

    error: str
    dead_rank: int | None = None
