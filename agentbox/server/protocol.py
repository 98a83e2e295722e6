"""Request bodies of the OpenAI routes. Unknown fields are accepted (clients send many); known fields are
range-checked so a bad value is a 400 naming its field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentbox.chat.effort import OpenAIEffort, ReasoningEffort


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    n: int = Field(1, ge=1, le=1, description="only n=1 is served")
    ignore_eos: bool = False
    session_id: str | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
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
    prompt: str | list[int] = Field(..., min_length=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None
