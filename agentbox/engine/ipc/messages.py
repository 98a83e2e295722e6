"""Typed messages between the API process and the engine core process. Small, picklable, nothing else.

Wire messages only: what a query answers is typed where it is made (the engine's counters in engine/stats.py,
the cache's and the sessions' views in engine/cache/stats.py) and crosses the pipe as those dataclasses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from agentbox.engine.cache.stats import SessionDetail, SessionDropped, SessionList
from agentbox.engine.exec.logprob import TokenLogprob
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.stats import EngineStats


@dataclass
class AddRequest:
    request_id: str
    # A list, or from the API process an int32 array (it pickles as its bytes: a list of 121k ids took ~20 ms
    # to pickle and unpickle); the engine process turns it into the request's list (core_process.py).
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    session_id: str | None = None
    # The API key's namespace ("" without several keys): sessions are inferred only among its own, and the
    # cached tokens reported count only prefixes its own sessions computed.
    namespace: str = ""
    # > 0: how many of the prompt's tokens the conversation's next turn will repeat: all but the part of the
    # template's generation prompt it renders otherwise (chat/generation_prompt.py). A hybrid model's prompt
    # snapshot is taken at or before it, where the next turn can resume.
    history_end: int = 0
    # A session's prompt as a delta (engine/ipc/prompt_delta.py): with shared_tokens > 0, prompt_token_ids are
    # the ids after the first shared_tokens of the prompt of version base_version (checked by prompt_check).
    prompt_version: int = 0  # this prompt's version under session_id (0: not kept)
    base_version: int = 0
    shared_tokens: int = 0
    prompt_check: int = 0


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
    num_drafted_tokens: int = 0  # speculative decoding, this request so far: draft tokens verified
    num_accepted_tokens: int = 0  # of those, kept
    session_id: str | None = None
    error: str | None = None
    error_code: str | None = None  # queue_full | admission_timeout -> 429; prompt_too_long -> 400


@dataclass
class StepOutputs:
    outputs: list[RequestOutput]


@dataclass(frozen=True)
class QueryFailed:
    error: str


QueryResult = EngineStats | SessionList | SessionDetail | SessionDropped | QueryFailed | None


@dataclass
class QueryReply:
    query_id: int
    result: QueryResult


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
    model_max_len: int = 0  # the model's own positions (max_model_len is at most this; the KV pool may cut it)
    # What the disk tier held at start (a restart's log counts what came back); disk_budget_bytes 0: no tier
    disk_budget_bytes: int = 0
    disk_pages: int = 0
    disk_sessions: int = 0
    disk_states: int = 0


@dataclass
class EngineFailed:
    """The engine could not start, or a tensor-parallel rank died (dead_rank) and the engine exited."""

    error: str
    dead_rank: int | None = None
