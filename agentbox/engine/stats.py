"""The engine's counters and the answer to a stats query, as typed dataclasses (never string-keyed dicts):
they cross the process boundary pickled, and the API process turns them into the JSON it serves with `to_json`,
whose shape /v1/stats, /metrics, /v1/sessions and `agentbox top` read: field names are the JSON keys."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from agentbox.engine.cache.state_snapshots import SnapshotStats
from agentbox.engine.cache.stats import CacheStats


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
    drafted_tokens: int = 0  # speculative decoding: draft tokens verified
    accepted_tokens: int = 0  # of those, kept (each one a decode step saved)


@dataclass(frozen=True)
class PoolStats:
    total_pages: int
    free_pages: int
    used_pages: int
    page_size: int
    running_pages: int
    # One page over every KV layer at each layer's own shape (one rank): used_pages x page_bytes is the KV in use
    page_bytes: int = 0
    kv_bytes_per_token: int = 0  # page_bytes / page_size: one rank's KV bytes per cached token (MLA: the latent)

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
class DrafterStats:
    """One draft source's verifies (engine/draft.py DraftSource): steps that scored one of its drafts, the tokens
    drafted and accepted, and the accepted tokens per such step (each step also yields one token of its own)."""

    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_step: float = 0.0


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding since start (engine/draft.py): mode "off" when the engine does not draft."""

    mode: str = "off"
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0  # accepted / drafted
    drafters: dict[str, DrafterStats] = field(default_factory=dict)  # by source: "suffix" (text matches), "mtp"


@dataclass(frozen=True)
class ExpertStats:
    """Where a MoE model's routed experts live (`serve --cpu-moe / --n-cpu-moe`) and the share of a step the
    host's experts take, from the clock around their compute; moe_layers 0: not a MoE model."""

    moe_layers: int = 0
    host_layers: int = 0  # the first host_layers MoE layers keep their experts in host RAM
    host_bytes: int = 0  # their expert weights (rank 0's shard)
    device: str = ""  # where the rest of the model runs: "cuda" or "cpu"
    host_method: str = ""  # the expert method the host layers run (CpuExperts: the CPU kernels)
    steps: int = 0
    cpu_expert_ms_per_step: float = 0.0  # mean over the steps since start
    cpu_expert_share: float = 0.0  # of the steps' wall time
    last_step_ms: float = 0.0
    last_cpu_expert_ms: float = 0.0


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
    snapshots: SnapshotStats | None = None  # hybrid models' recurrent-state snapshots; None: no such store
    speculative: SpecStats = field(default_factory=SpecStats)
    experts: ExpertStats = field(default_factory=ExpertStats)


def to_json(msg: Any) -> dict[str, Any]:
    """A query result as the plain JSON the HTTP API serves: field names as keys, enums by value."""
    return asdict(msg, dict_factory=lambda items: {k: v.value if isinstance(v, Enum) else v for k, v in items})
