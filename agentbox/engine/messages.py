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
class StatsQuery:
    query_id: int


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
    error: str | None = None


@dataclass
class StepOutputs:
    outputs: list[RequestOutput]


@dataclass
class StatsReply:
    query_id: int
    stats: dict


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


@dataclass
class EngineFailed:
    error: str
