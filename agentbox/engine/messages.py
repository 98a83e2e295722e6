"""Typed messages between the API process and the engine core process. Small, picklable, nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentbox.engine.sampling import SamplingParams


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    session_id: str | None = None


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Query:
    """A read (or a session drop) answered between steps: kind is stats | sessions | session | drop_session."""

    query_id: int
    kind: str
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
    error_code: str | None = None  # queue_full | admission_timeout -> 503; prompt_too_long -> 400


@dataclass
class StepOutputs:
    outputs: list[RequestOutput]


@dataclass
class QueryReply:
    query_id: int
    result: dict | None


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
