"""Request bodies of the OpenAI routes. Unknown fields are accepted (clients send many); known fields are
range-checked so a bad value is a 400 naming its field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentbox.chat.effort import OpenAIEffort, ReasoningEffort
from agentbox.engine.sampling import (
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_MAX,
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    SEED_MAX,
    SEED_MIN,
    TOKEN_ID_MAX,
    TOP_K_MAX,
)
from agentbox.server.session_key import MAX_SESSION_ID_CHARS

StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_MAX)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(BaseModel):
    # Every bound here is one past which the engine would fail (engine/sampling.py says which); nan and
    # infinity (Python's JSON parser accepts them) are refused for every float.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(..., max_length=1000)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=TOP_K_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_MIN, le=REPETITION_PENALTY_MAX)
    n: int = Field(1, ge=1, le=1, description="only n=1 is served")
    ignore_eos: bool = False
    session_id: str | None = Field(None, max_length=MAX_SESSION_ID_CHARS)
    user: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: OpenAIEffort | None = None


class ResponsesReasoning(BaseModel):
    """Responses' `reasoning` object (`summary` and others accepted, unused)."""

    model_config = ConfigDict(extra="allow")
    effort: OpenAIEffort | None = None


def effort_of(value: str | None) -> ReasoningEffort | None:
    return ReasoningEffort(value) if value is not None else None


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] = Field(..., min_length=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None
