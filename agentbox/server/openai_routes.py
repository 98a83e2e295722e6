"""OpenAI-compatible routes: /v1/chat/completions and /v1/completions, streaming (SSE) and not."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from agentbox.chat.effort import ReasoningEffort
from agentbox.engine.exec.logprob import TokenLogprob
from agentbox.engine.sampling import SamplingParams
from agentbox.server.chat_pipeline import Conversation, FinalOutput, checked, fold, grammar_of, prepare_chat
from agentbox.server.disconnect import until_disconnect
from agentbox.server.errors import APIError, as_api_error
from agentbox.server.fast_json import FastJSONRoute
from agentbox.server.generation import GenEvent, Usage, generate, new_id
from agentbox.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, effort_of
from agentbox.server.session_key import session_key
from agentbox.server.state import ServerState

router = APIRouter(route_class=FastJSONRoute)  # orjson bodies: server/fast_json.py


async def _chain(first: GenEvent, rest: AsyncIterator[GenEvent]) -> AsyncIterator[GenEvent]:
    """The first event (awaited before the 200 went out, so errors become HTTP errors) and then the rest."""
    yield first
    async for e in rest:
        yield e


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def sampling_from(state: ServerState, body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=state.pick("temperature", body.temperature, 1.0),
        top_p=state.pick("top_p", body.top_p, 1.0),
        top_k=state.pick("top_k", body.top_k, 0),
        min_p=state.pick("min_p", body.min_p, 0.0),
        seed=body.seed,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logprobs=logprobs,
    )
    return checked(sp)


def _chat_logprobs(state: ServerState, lps: list[TokenLogprob]) -> dict:
    tok = state.tokenizer

    def entry(tid: int, lp: float) -> dict:
        s = tok.decode([tid])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]} for x in lps]}


def conversation_of(body: ChatCompletionRequest) -> Conversation:
    extra = body.model_extra or {}
    effort = effort_of(body.reasoning_effort)
    return Conversation(
        messages=body.messages, tools=body.tools, tool_choice=body.tool_choice,
        tool_params=[f"tools[{i}].function.parameters" if isinstance(t, dict) and "function" in t
                     else f"tools[{i}].parameters" for i, t in enumerate(body.tools or [])],
        response_format=body.response_format,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        structured_tool_calls=extra.get("structured_tool_calls") is not False,
        enable_thinking=_enable_thinking(extra, effort), reasoning_effort=effort,
    )


def _enable_thinking(extra: dict[str, Any], effort: ReasoningEffort | None) -> bool | None:
    """vLLM's `chat_template_kwargs.enable_thinking`, or `reasoning_effort: none` to switch it off."""
    kw = extra.get("chat_template_kwargs")
    if isinstance(kw, dict) and isinstance(kw.get("enable_thinking"), bool):
        return kw["enable_thinking"]
    if effort is not None and effort.switches_thinking_off:
        return False
    return None


def _message(out: FinalOutput) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": out.content if out.content or not out.tool_calls else None}
    if out.reasoning:
        msg["reasoning_content"] = msg["reasoning"] = out.reasoning
    if out.tool_calls:
        msg["tool_calls"] = [c.to_openai() for c in out.tool_calls]
    return msg


async def _chat_answer(state: ServerState, events: AsyncIterator[GenEvent], proc: Any, cid: str, created: int,
                       logprobs: int | None) -> JSONResponse:
    """The non-streaming chat answer, once the generation ends."""
    deltas, lps, last = [], [], None
    async for ev in events:
        deltas += proc.feed(ev.text)
        lps.extend(ev.logprobs or [])
        last = ev
    assert last is not None
    deltas += proc.finish()
    return JSONResponse({
        "id": cid, "object": "chat.completion", "created": created, "model": state.model_name,
        "choices": [{
            "index": 0, "message": _message(fold(deltas)),
            "logprobs": _chat_logprobs(state, lps) if logprobs is not None else None,
            "finish_reason": proc.finish_reason(last.finish_reason),
        }],
        "usage": last.usage.openai(),
    })


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.agentbox
    state.check_model(body.model)
    chat = await state.off_loop(prepare_chat, state, conversation_of(body))
    prompt = chat.prompt_ids
    max_tokens = state.clamp_max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sp = sampling_from(state, body, max_tokens, logprobs)
    sp.grammar = await grammar_of(state, chat)
    sid = session_key(request.headers, body)
    cid, created = new_id("chatcmpl"), int(time.time())
    events = generate(state, prompt, sp, sid, cid, record=(chat.conv.messages, chat.conv.tools),
                      history_end=chat.history_end)
    proc = chat.output()
    if not body.stream:
        return await until_disconnect(request, _chat_answer(state, events, proc, cid, created, logprobs))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    # Fail before the 200 goes out: the first event carries engine-side errors (e.g. the pool).
    first = await until_disconnect(request, anext(events))

    async def stream() -> AsyncIterator[str]:
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
        yield sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        usage = Usage()

        def chunk(delta: dict[str, Any], lp: dict | None = None) -> str:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
            if lp is not None:
                choice["logprobs"] = lp
            return sse({**base, "choices": [choice]})

        try:
            async for ev in _chain(first, events):
                usage = ev.usage
                deltas = proc.feed(ev.text) + (proc.finish() if ev.finished else [])
                lp = _chat_logprobs(state, ev.logprobs) if logprobs is not None and ev.logprobs else None
                if lp is not None and not deltas:
                    yield chunk({}, lp)  # logprobs of tokens whose text is still held back
                for i, d in enumerate(deltas):
                    yield chunk(d.to_openai(), lp if i == 0 else None)
                if ev.finished:
                    reason = proc.finish_reason(ev.finish_reason)
                    yield sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": reason}]})
        except Exception as exc:  # noqa: BLE001 - after the 200: the stream ends with a typed error event
            e = as_api_error(exc)
            yield sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
        finally:
            await events.aclose()
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage.openai()})
        yield sse("[DONE]")

    return StreamingResponse(stream(), media_type="text/event-stream")


def _completion_logprobs(state: ServerState, lps: list[TokenLogprob], offset0: int) -> dict:
    tok = state.tokenizer
    tokens = [tok.decode([x.token_id]) for x in lps]
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [x.logprob for x in lps],
        "top_logprobs": [{tok.decode([t]): v for t, v in x.top} for x in lps],
        "text_offset": offsets,
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.agentbox
    state.check_model(body.model)
    if isinstance(body.prompt, str):
        state.check_prompt_chars(body.prompt, "prompt")
        prompt = await state.off_loop(state.tokenizer.encode, body.prompt, add_special_tokens=True)
    else:
        if any(t < 0 or t >= state.info.vocab_size for t in body.prompt):
            raise APIError(400, f"token ids must be in [0, {state.info.vocab_size})", param="prompt")
        prompt = list(body.prompt)
    state.check_prompt(len(prompt), "prompt")
    max_tokens = state.clamp_max_tokens(body.max_tokens or 16, len(prompt))
    sp = sampling_from(state, body, max_tokens, body.logprobs)
    sid = session_key(request.headers, body)
    cid, created = new_id("cmpl"), int(time.time())
    events = generate(state, prompt, sp, sid, cid)
    base = {"id": cid, "object": "text_completion", "created": created, "model": state.model_name}
    if not body.stream:
        async def answer() -> JSONResponse:
            text, lps, last = "", [], None
            async for ev in events:
                text += ev.text
                lps.extend(ev.logprobs or [])
                last = ev
            assert last is not None
            return JSONResponse({**base, "choices": [{
                "index": 0, "text": text, "finish_reason": last.finish_reason,
                "logprobs": _completion_logprobs(state, lps, 0) if body.logprobs is not None else None,
            }], "usage": last.usage.openai()})

        return await until_disconnect(request, answer())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    first = await until_disconnect(request, anext(events))

    async def stream() -> AsyncIterator[str]:
        usage, offset = Usage(), 0

        try:
            async for ev in _chain(first, events):
                usage = ev.usage
                lp = _completion_logprobs(state, ev.logprobs, offset) if body.logprobs is not None and ev.logprobs else None
                offset += len(ev.text)
                if ev.text or ev.finished:
                    yield sse({**base, "choices": [{
                        "index": 0, "text": ev.text, "logprobs": lp,
                        "finish_reason": ev.finish_reason if ev.finished else None,
                    }]})
        except Exception as exc:  # noqa: BLE001 - after the 200: the stream ends with a typed error event
            e = as_api_error(exc)
            yield sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
        finally:
            await events.aclose()
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage.openai()})
        yield sse("[DONE]")

    return StreamingResponse(stream(), media_type="text/event-stream")
