"""Anthropic Messages: `POST /v1/messages` (what Claude Code speaks) and `/v1/messages/count_tokens`.

The request is translated to the shared chat pipeline's OpenAI-style conversation and back. Errors on
these routes are Anthropic-shaped, so bodies are parsed here rather than by FastAPI (whose validation
errors the app answers in OpenAI's shape).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentbox.chat.effort import ANTHROPIC_EFFORTS, ReasoningEffort
from agentbox.engine.sampling import MAX_STOP, MAX_TOKENS_MAX, TOP_K_MAX, SamplingParams
from agentbox.server.chat_pipeline import Conversation, PreparedChat, checked, fold, grammar_of, prepare_chat
from agentbox.server.disconnect import until_disconnect
from agentbox.server.errors import (
    ANTHROPIC_ERROR_TYPES,
    APIError,
    anthropic_error,
    as_api_error,
    parse_json_body,
)
from agentbox.server.fast_json import FastJSONRoute
from agentbox.server.generation import GenEvent, Usage, generate, new_id
from agentbox.server.protocol import StopString
from agentbox.server.session_key import session_key
from agentbox.server.state import ServerState

router = APIRouter(route_class=FastJSONRoute)  # orjson bodies: server/fast_json.py

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class Thinking(BaseModel):
    """`thinking`: on, off or adaptive. `budget_tokens` is range-checked and otherwise unused (chat/effort.py)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_MAX)


class MessagesBody(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None


class CreateBody(MessagesBody):
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_MAX)
    stream: bool = False
    stop_sequences: list[StopString] | None = Field(None, max_length=MAX_STOP)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=TOP_K_MAX)


# ---- errors ---------------------------------------------------------------------------------------
def _validation_message(e: ValidationError) -> str:
    first = e.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return f"{loc}: {first.get('msg', 'invalid value')}" if loc else str(first.get("msg"))


async def _answer(handler: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await handler()
    except APIError as e:
        return anthropic_error(e.status, e.message, e.headers)  # Retry-After on a 429 included
    except ValidationError as e:
        return anthropic_error(400, _validation_message(e))


# ---- request translation -------------------------------------------------------------------------
def _text_of(content: Any) -> str:
    """A tool_result's content (a string or blocks) as text; images cannot reach a text model."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for b in content:
        if isinstance(b, dict) and b.get("type") == "text":
            parts.append(str(b.get("text", "")))
        elif isinstance(b, dict):
            parts.append(f"[{b.get('type', 'block')} omitted]")
    return "\n".join(parts)


def _user_blocks(blocks: list[Any], out: list[dict]) -> None:
    """tool_result blocks become tool messages (first, as the call order requires); text a user message."""
    texts: list[str] = []
    for b in blocks:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_result":
            text = _text_of(b.get("content"))
            if b.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id", ""), "content": text})
        elif kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind in ("image", "document"):
            texts.append(f"[{kind} omitted: this model reads text only]")
        else:
            raise APIError(400, f"unsupported content block type {kind!r} in a user message")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})


def _assistant_blocks(blocks: list[Any]) -> dict:
    texts, reasoning, calls = [], [], []
    for b in blocks:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "thinking":
            reasoning.append(str(b.get("thinking", "")))
        elif kind == "tool_use":
            # Compact-separator JSON, as the grammar writes it: the re-rendered turn matches the cache.
            args = json.dumps(b.get("input") or {}, ensure_ascii=False)
            calls.append({"id": b.get("id", ""), "type": "function", "function": {"name": b.get("name", ""), "arguments": args}})
        elif kind == "redacted_thinking":
            continue
        else:
            raise APIError(400, f"unsupported content block type {kind!r} in an assistant message")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def to_messages(body: MessagesBody) -> list[dict]:
    out: list[dict] = []
    if body.system:
        out.append({"role": "system", "content": body.system if isinstance(body.system, str) else
                    [{"type": "text", "text": str(b.get("text", ""))} for b in body.system if b.get("type", "text") == "text"]})
    for i, m in enumerate(body.messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant", "system"):
            raise APIError(400, f"messages.{i}.role: must be 'user' or 'assistant' (got {role!r})")
        if isinstance(content, str) or content is None:
            out.append({"role": role, "content": content or ""})
        elif not isinstance(content, list):
            raise APIError(400, f"messages.{i}.content: must be a string or a list of content blocks")
        elif role == "assistant":
            out.append(_assistant_blocks(content))
        elif role == "system":
            out.append({"role": "system", "content": _text_of(content)})
        else:
            _user_blocks(content, out)
    return out


def _tools(tools: list[dict] | None) -> list[dict] | None:
    """Client tools only: server tools (web search, …) carry no input_schema and run elsewhere."""
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise APIError(400, f"tools.{i}.name: every tool needs a name the model can call it by")
    kept = [{"name": t["name"], "description": t.get("description", ""), "input_schema": t["input_schema"]}
            for t in tools or [] if "input_schema" in t]
    return kept or None


def _tool_choice(tc: dict | None) -> tuple[str | dict | None, bool]:
    """(OpenAI-style tool_choice, parallel allowed)."""
    if tc is None:
        return None, True
    parallel = not tc.get("disable_parallel_tool_use", False)
    kind = tc.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}, parallel
    raise APIError(400, f"tool_choice.type must be auto, any, tool or none (got {kind!r})")


def _thinking(th: Thinking | None) -> bool | None:
    if th is None:
        return None
    return th.type != "disabled"


def _response_format(output_config: Any) -> dict | None:
    """`output_config.format` (`{"type": "json_schema", "schema": …}`) as the chat pipeline's response_format,
    enforced by the grammar as on the OpenAI routes (Claude Code uses it for its title request)."""
    if output_config is None:
        return None
    fmt = output_config.get("format") if isinstance(output_config, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise APIError(400, "output_config.format.type: only 'json_schema' is supported")
    schema = fmt.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise APIError(400, "output_config.format.schema: must be a JSON schema object")
    return {"type": "json_schema", "json_schema": {"schema": schema or {"type": "object"}}}


def _effort(output_config: Any) -> ReasoningEffort | None:
    """`output_config.effort` (low … max). `thinking.budget_tokens` carries none (chat/effort.py says why)."""
    effort = output_config.get("effort") if isinstance(output_config, dict) else None
    if effort is None:
        return None
    if effort not in ANTHROPIC_EFFORTS:
        raise APIError(400, f"output_config.effort: {effort!r:.40} is not one of {', '.join(ANTHROPIC_EFFORTS)}")
    return ReasoningEffort(effort)


def conversation_of(body: MessagesBody) -> Conversation:
    choice, parallel = _tool_choice(body.tool_choice)
    extra = body.model_extra or {}
    return Conversation(messages=to_messages(body), tools=_tools(body.tools), tool_choice=choice,
                        tool_params=[f"tools[{i}].input_schema" for i, t in enumerate(body.tools or [])
                                     if "input_schema" in t], format_param="output_config.format.schema",
                        response_format=_response_format(extra.get("output_config")),
                        parallel_tool_calls=parallel, enable_thinking=_thinking(body.thinking),
                        reasoning_effort=_effort(extra.get("output_config")),
                        structured_tool_calls=extra.get("structured_tool_calls") is not False)


# ---- response building ---------------------------------------------------------------------------
def anthropic_usage(u: Usage) -> dict:
    """Anthropic counts input as uncached + cache reads + cache writes; we report no separate writes (every
    prompt is cached as a side effect), so input_tokens + cache_read_input_tokens is the whole prompt."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _signature(text: str) -> str:
    """Claude Code keeps thinking blocks with their signature; ours is a digest of the reasoning text."""
    return hashlib.sha256(text.encode()).hexdigest()


def stop_reason(state: ServerState, chat_reason: str | None, stops: list[str], last: GenEvent,
                out_ids: list[int]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). A stop string ended the turn when it stopped on a non-EOS token."""
    if chat_reason in STOP_REASONS:
        return STOP_REASONS[chat_reason], None
    if chat_reason == "stop" and stops and not (last.token_ids and last.token_ids[-1] in state.info.eos_token_ids):
        raw = state.tokenizer.decode(out_ids, skip_special_tokens=True)
        hits = [(raw.find(s), s) for s in stops if s and raw.find(s) >= 0]
        if hits:
            return "stop_sequence", min(hits)[1]
    return "end_turn", None


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data}, ensure_ascii=False)}\n\n"


async def _prepare(request: Request, body: CreateBody) -> tuple[ServerState, PreparedChat, SamplingParams, str | None]:
    state: ServerState = request.app.state.agentbox
    state.check_model(body.model)
    chat = await state.off_loop(prepare_chat, state, conversation_of(body))
    sp = checked(SamplingParams(
        max_tokens=state.clamp_max_tokens(body.max_tokens, len(chat.prompt_ids)),
        temperature=state.pick("temperature", body.temperature, 1.0),
        top_p=state.pick("top_p", body.top_p, 1.0),
        top_k=state.pick("top_k", body.top_k, 0),
        stop=list(body.stop_sequences or []),
    ))
    sp.grammar = await grammar_of(state, chat)
    return state, chat, sp, session_key(request.headers, body)


async def _message(state: ServerState, events: AsyncIterator[GenEvent], proc: Any, head: dict,
                   sp: SamplingParams) -> JSONResponse:
    """The non-streaming message, once the generation ends."""
    out_ids: list[int] = []
    deltas, last = [], None
    async for ev in events:
        deltas += proc.feed(ev.text)
        out_ids += ev.token_ids
        last = ev
    assert last is not None
    deltas += proc.finish()
    out = fold(deltas)
    content: list[dict] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": _signature(out.reasoning)})
    if out.content:
        content.append({"type": "text", "text": out.content})
    for c in out.tool_calls:
        try:
            args = json.loads(c.arguments or "{}")
        except ValueError:
            args = {"_raw": c.arguments}  # malformed: kept visible rather than dropped
        content.append({"type": "tool_use", "id": _tool_use_id(c.id), "name": c.name, "input": args})
    reason, seq = stop_reason(state, proc.finish_reason(last.finish_reason), sp.stop, last, out_ids)
    return JSONResponse({**head, "content": content, "stop_reason": reason, "stop_sequence": seq,
                         "usage": anthropic_usage(last.usage)})


@router.post("/v1/messages")
async def messages(request: Request) -> Any:
    async def handle() -> Any:
        body = CreateBody.model_validate(parse_json_body(await request.body()))
        state, chat, sp, sid = await _prepare(request, body)
        mid = "msg_" + new_id("a")[2:]
        events = generate(state, chat.prompt_ids, sp, sid, mid, record=(chat.conv.messages, chat.conv.tools),
                      history_end=chat.history_end)
        proc = chat.output()
        head = {"id": mid, "type": "message", "role": "assistant", "model": state.model_name}
        out_ids: list[int] = []
        if not body.stream:
            return await until_disconnect(request, _message(state, events, proc, head, sp))
        first = await until_disconnect(request, anext(events))  # engine errors: a 4xx/5xx before the 200
        return StreamingResponse(_stream(state, head, first, events, proc, sp, out_ids),
                                 media_type="text/event-stream")

    return await _answer(handle)


async def _stream(state: ServerState, head: dict, first: GenEvent, events: AsyncIterator[GenEvent], proc: Any,
                  sp: SamplingParams, out_ids: list[int]) -> AsyncIterator[str]:
    start_usage = {**anthropic_usage(first.usage), "output_tokens": 0}
    yield sse("message_start", {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                            "usage": start_usage}})
    yield sse("ping", {})
    block: dict[str, Any] = {"index": -1, "kind": None, "text": ""}

    def close() -> list[str]:
        if block["kind"] is None:
            return []
        out = []
        if block["kind"] == "thinking":
            out.append(sse("content_block_delta", {"index": block["index"], "delta": {
                "type": "signature_delta", "signature": _signature(block["text"])}}))
        out.append(sse("content_block_stop", {"index": block["index"]}))
        block["kind"] = None
        return out

    def open_block(kind: str, content_block: dict) -> list[str]:
        out = close()
        block.update(index=block["index"] + 1, kind=kind, text="")
        out.append(sse("content_block_start", {"index": block["index"], "content_block": content_block}))
        return out

    def emit(d: Any) -> list[str]:
        out: list[str] = []
        if d.reasoning:
            if block["kind"] != "thinking":
                out += open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            block["text"] += d.reasoning
            out.append(sse("content_block_delta", {"index": block["index"], "delta": {
                "type": "thinking_delta", "thinking": d.reasoning}}))
        if d.content:
            if block["kind"] != "text":
                out += open_block("text", {"type": "text", "text": ""})
            out.append(sse("content_block_delta", {"index": block["index"], "delta": {
                "type": "text_delta", "text": d.content}}))
        if (tc := d.tool_call) is not None:
            if tc.id is not None:
                out += open_block("tool_use", {"type": "tool_use", "id": _tool_use_id(tc.id), "name": tc.name,
                                               "input": {}})
            if tc.arguments:
                out.append(sse("content_block_delta", {"index": block["index"], "delta": {
                    "type": "input_json_delta", "partial_json": tc.arguments}}))
        return out

    last = first
    try:
        ev = first
        while True:
            last = ev
            out_ids += ev.token_ids
            for d in proc.feed(ev.text) + (proc.finish() if ev.finished else []):
                for chunk in emit(d):
                    yield chunk
            if ev.finished:
                break
            ev = await anext(events)
    except Exception as exc:  # noqa: BLE001 - after the 200: the stream ends with a typed error event
        e = as_api_error(exc)
        yield sse("error", {"error": {"type": ANTHROPIC_ERROR_TYPES.get(e.status, "api_error"), "message": e.message}})
        return
    finally:
        await events.aclose()  # a client that went away aborts the engine request
    for chunk in close():
        yield chunk
    reason, seq = stop_reason(state, proc.finish_reason(last.finish_reason), sp.stop, last, out_ids)
    yield sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                "usage": anthropic_usage(last.usage)})
    yield sse("message_stop", {})


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Any:
    async def handle() -> Any:
        body = MessagesBody.model_validate(parse_json_body(await request.body()))
        state: ServerState = request.app.state.agentbox
        state.check_model(body.model)
        chat = await state.off_loop(prepare_chat, state, conversation_of(body), check_length=False)
        return JSONResponse({"input_tokens": len(chat.prompt_ids)})

    return await _answer(handle)
