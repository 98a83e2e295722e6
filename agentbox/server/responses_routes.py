"""OpenAI Responses: `POST /v1/responses` (what Codex speaks), streaming and not.

Input items become the chat pipeline's OpenAI-style messages; the pipeline's deltas become output items
(reasoning, message, function_call), each announced with `output_item.added` before any of its deltas.
Nothing is stored: `previous_response_id` is refused, clients send the whole input each turn.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from agentbox.chat.tool_parsers import Delta
from agentbox.engine.sampling import MAX_TOKENS_MAX, SamplingParams
from agentbox.server.chat_pipeline import Conversation, OutputProcessor, checked, grammar_of, prepare_chat
from agentbox.server.disconnect import until_disconnect
from agentbox.server.errors import APIError, as_api_error
from agentbox.server.fast_json import FastJSONRoute
from agentbox.server.generation import GenEvent, Usage, generate, new_id
from agentbox.server.protocol import MAX_SESSION_ID_CHARS, ResponsesReasoning, effort_of
from agentbox.server.session_key import session_key
from agentbox.server.state import ServerState

router = APIRouter(route_class=FastJSONRoute)  # orjson bodies: server/fast_json.py


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    reasoning: ResponsesReasoning | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    session_id: str | None = Field(None, max_length=MAX_SESSION_ID_CHARS)


# ---- request translation -------------------------------------------------------------------------
def _parts_text(content: Any) -> Any:
    """Responses content parts (input_text / output_text) as chat text parts; others refused by render."""
    if isinstance(content, list):
        return [{"type": "text", "text": p.get("text", "")} if isinstance(p, dict) and p.get("type") in
                ("input_text", "output_text", "text") else p for p in content]
    return content


def to_messages(body: ResponsesRequest) -> list[dict]:
    out: list[dict] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    reasoning: str | None = None  # a reasoning item belongs to the assistant turn that follows it

    def assistant() -> dict:
        nonlocal reasoning
        last = out[-1] if out else None
        if last is None or last["role"] != "assistant" or reasoning is not None:
            last = {"role": "assistant", "content": ""}
            out.append(last)
        if reasoning is not None:
            last["reasoning_content"], reasoning = reasoning, None
        return last

    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"input[{i}].role must be user, assistant, system or developer", param=f"input[{i}].role")
            if role == "assistant":
                msg = assistant()
                text = item.get("content")
                msg["content"] += text if isinstance(text, str) else "".join(
                    p.get("text", "") for p in text or [] if isinstance(p, dict))
            else:
                out.append({"role": role, "content": _parts_text(item.get("content"))})
        elif kind == "function_call":
            msg = assistant()
            msg.setdefault("tool_calls", []).append({"id": item.get("call_id", ""), "type": "function", "function": {
                "name": item.get("name", ""), "arguments": item.get("arguments") or "{}"}})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else "\n".join(
                p.get("text", "") for p in output or [] if isinstance(p, dict))
            out.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise APIError(400, f"input[{i}].type {kind!r} is not supported here", param=f"input[{i}].type")
    return out


def _tools(tools: list[dict] | None) -> list[dict] | None:
    """Function tools (flat Responses shape); hosted tools (web_search, …) cannot run here and are dropped. A
    function tool without a name is a 400: the model could never call it."""
    for i, t in enumerate(tools or []):
        if t.get("type") == "function" and (not isinstance(t.get("name"), str) or not t["name"]):
            raise APIError(400, f"tools[{i}].name is missing: every function tool needs a name the model can call "
                           "it by", param=f"tools[{i}].name")
    kept = [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                               "parameters": t.get("parameters") or {"type": "object", "properties": {}}}}
            for t in tools or [] if t.get("type") == "function" and "name" in t]
    return kept or None


def _tool_choice(tc: str | dict | None) -> str | dict | None:
    if isinstance(tc, dict) and tc.get("type") == "function" and "name" in tc:
        return {"type": "function", "function": {"name": tc["name"]}}
    return tc


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format") or {}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    return None


def conversation_of(body: ResponsesRequest) -> Conversation:
    extra = body.model_extra or {}
    effort = effort_of(body.reasoning.effort if body.reasoning else None)
    return Conversation(
        messages=to_messages(body), tools=_tools(body.tools), tool_choice=_tool_choice(body.tool_choice),
        tool_params=[f"tools[{i}].parameters" for i, t in enumerate(body.tools or []) if t.get("type") == "function"],
        format_param="text.format.schema",
        response_format=_response_format(body.text), parallel_tool_calls=body.parallel_tool_calls is not False,
        structured_tool_calls=extra.get("structured_tool_calls") is not False,
        enable_thinking=False if effort is not None and effort.switches_thinking_off else None,
        reasoning_effort=effort,
    )


# ---- output items ----------------------------------------------------------------------------------
def responses_usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class OutputBuilder:
    """Turns pipeline deltas into Responses events and the final output list (the same items for both)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.open: dict | None = None
        self.seq = 0

    def event(self, kind: str, **data: Any) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return ev

    def _start(self, item: dict) -> list[dict]:
        out = self.close()
        self.items.append(item)
        self.open = item
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=_hidden(item)))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx, out = len(self.items) - 1, []
        if item["type"] == "message":
            part = {"type": "output_text", "text": item.pop("_text"), "annotations": []}
            item["content"] = [part]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                                  text=part["text"]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=idx,
                                  content_index=0, part=part))
        elif item["type"] == "reasoning":
            text = item.pop("_text")
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                                  content_index=0, text=text))
        elif item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                  arguments=item["arguments"]))
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=idx, item=item))
        return out

    def feed(self, d: Delta) -> list[dict]:
        out: list[dict] = []
        idx = lambda: len(self.items) - 1  # noqa: E731 - the open item's index, read after _start
        if d.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._start({"type": "reasoning", "id": "rs_" + new_id("r")[2:], "summary": [], "_text": ""})
            self.open["_text"] += d.reasoning  # type: ignore[index]
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=idx(),  # type: ignore[index]
                                  content_index=0, delta=d.reasoning))
        if d.content:
            if self.open is None or self.open["type"] != "message":
                out += self._start({"type": "message", "id": "msg_" + new_id("m")[2:], "status": "in_progress",
                                    "role": "assistant", "content": [], "_text": ""})
            self.open["_text"] += d.content  # type: ignore[index]
            out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=idx(),  # type: ignore[index]
                                  content_index=0, delta=d.content, logprobs=[]))
        if (tc := d.tool_call) is not None:
            if tc.id is not None:
                out += self._start({"type": "function_call", "id": "fc_" + tc.id.removeprefix("call_"),
                                    "call_id": tc.id, "name": tc.name, "arguments": "", "status": "in_progress"})
            if tc.arguments and self.open is not None:
                self.open["arguments"] += tc.arguments
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=idx(), delta=tc.arguments))
        return out


def _hidden(item: dict) -> dict:
    return {k: v for k, v in item.items() if not k.startswith("_")}


# ---- the route ------------------------------------------------------------------------------------
@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Any:
    state: ServerState = request.app.state.agentbox
    state.check_model(body.model)
    if body.previous_response_id:
        raise APIError(400, "previous_response_id is not supported: responses are not stored; send the full input",
                       param="previous_response_id")
    chat = await state.off_loop(prepare_chat, state, conversation_of(body), param="input")
    sp = checked(SamplingParams(
        max_tokens=state.clamp_max_tokens(body.max_output_tokens, len(chat.prompt_ids)),
        temperature=state.pick("temperature", body.temperature, 1.0),
        top_p=state.pick("top_p", body.top_p, 1.0),
    ))
    sp.grammar = await grammar_of(state, chat)
    sid = session_key(request.headers, body)
    rid = "resp_" + new_id("r")[2:]
    created = int(time.time())
    events = generate(state, chat.prompt_ids, sp, sid, rid, record=(chat.conv.messages, chat.conv.tools),
                      history_end=chat.history_end)
    proc = chat.output()
    builder = OutputBuilder()

    def response(status: str, output: list[dict], usage: Usage | None, reason: str | None = None) -> dict:
        return {
            "id": rid, "object": "response", "created_at": created, "model": state.model_name, "status": status,
            "output": [_hidden(i) for i in output], "usage": responses_usage(usage) if usage else None,
            "instructions": body.instructions, "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False, "text": body.text or {"format": {"type": "text"}},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "max_output_tokens": body.max_output_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
            "previous_response_id": None, "reasoning": body.reasoning.model_dump() if body.reasoning else None, "store": False, "metadata": {},
            "output_text": "".join(p["text"] for i in output if i["type"] == "message" for p in i.get("content", [])),
        }

    def status_of(proc: OutputProcessor, last: GenEvent) -> str:
        return "incomplete" if last.finish_reason == "length" and not proc.has_tool_calls else "completed"

    if not body.stream:
        async def answer() -> JSONResponse:
            last = None
            async for ev in events:
                for d in proc.feed(ev.text):
                    builder.feed(d)
                last = ev
            assert last is not None
            for d in proc.finish():
                builder.feed(d)
            builder.close()
            return JSONResponse(response(status_of(proc, last), builder.items, last.usage))

        return await until_disconnect(request, answer())

    first = await until_disconnect(request, anext(events))

    def sse(ev: dict) -> str:
        return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"

    async def stream() -> AsyncIterator[str]:
        yield sse(builder.event("response.created", response=response("in_progress", [], None)))
        yield sse(builder.event("response.in_progress", response=response("in_progress", [], None)))
        ev, last = first, first
        try:
            while True:
                last = ev
                for d in proc.feed(ev.text) + (proc.finish() if ev.finished else []):
                    for e in builder.feed(d):
                        yield sse(e)
                if ev.finished:
                    break
                ev = await anext(events)
        except Exception as exc:  # noqa: BLE001 - after the 200: the stream ends with a typed error event
            e = as_api_error(exc)
            yield sse(builder.event("response.failed", response={**response("failed", builder.items, None),
                                                                 "error": {"code": e.code or "server_error", "message": e.message}}))
            return
        finally:
            await events.aclose()  # a client that went away aborts the engine request
        for e in builder.close():
            yield sse(e)
        status = status_of(proc, last)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield sse(builder.event(kind, response=response(status, builder.items, last.usage)))

    return StreamingResponse(stream(), media_type="text/event-stream")
