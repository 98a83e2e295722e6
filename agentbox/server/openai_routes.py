"""OpenAI-compatible routes: /v1/chat/completions and /v1/completions, streaming (SSE) and not."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from agentbox.engine.messages import TokenLogprob
from agentbox.engine.sampling import InvalidParam, SamplingParams
from agentbox.server.errors import APIError
from agentbox.server.generation import GenEvent, ServerState, Usage, generate, new_id
from agentbox.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from agentbox.server.session_key import session_key

router = APIRouter()


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def sampling_from(body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logprobs=logprobs,
    )
    try:
        return sp.validate()
    except InvalidParam as e:
        raise APIError(400, str(e), param=e.field, code="invalid_value") from e


def _text_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in ("text", "input_text"))
    raise APIError(400, "message content must be a string or a list of text parts", param="messages")


def render_chat(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    msgs = []
    for i, m in enumerate(body.messages):
        if not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] has no 'role'", param=f"messages[{i}].role")
        msgs.append({**m, "content": _text_content(m.get("content"))})
    try:
        text = state.tokenizer.apply_chat_template(
            msgs, tools=body.tools, add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # a template error is the request's fault (roles out of order, etc.)
        raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from e
    return state.tokenizer.encode(text, add_special_tokens=False)


def _chat_logprobs(state: ServerState, lps: list[TokenLogprob]) -> dict:
    tok = state.tokenizer

    def entry(tid: int, lp: float) -> dict:
        s = tok.decode([tid])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]} for x in lps]}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.agentbox
    state.check_model(body.model)
    prompt = render_chat(state, body)
    state.check_prompt(len(prompt), "messages")
    max_tokens = state.clamp_max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sp = sampling_from(body, max_tokens, logprobs)
    sid = session_key(request.headers, body.model_dump())
    cid, created = new_id("chatcmpl"), int(time.time())
    events = generate(state, prompt, sp, sid, cid)
    if not body.stream:
        text, lps, last = "", [], None
        async for ev in events:
            text += ev.text
            lps.extend(ev.logprobs or [])
            last = ev
        assert last is not None
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": state.model_name,
            "choices": [{
                "index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": _chat_logprobs(state, lps) if logprobs is not None else None,
                "finish_reason": last.finish_reason,
            }],
            "usage": last.usage.openai(),
        })
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    # Fail before the 200 goes out: the first event carries engine-side errors (e.g. the pool).
    first = await anext(events)

    async def stream() -> AsyncIterator[str]:
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
        yield sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        usage = Usage()

        async def all_events() -> AsyncIterator[GenEvent]:
            yield first
            async for e in events:
                yield e

        try:
            async for ev in all_events():
                usage = ev.usage
                choice: dict[str, Any] = {"index": 0, "delta": {"content": ev.text} if ev.text else {}, "finish_reason": None}
                if logprobs is not None and ev.logprobs:
                    choice["logprobs"] = _chat_logprobs(state, ev.logprobs)
                if ev.text or choice.get("logprobs"):
                    yield sse({**base, "choices": [choice]})
                if ev.finished:
                    yield sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": ev.finish_reason}]})
        except APIError as e:
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
        prompt = state.tokenizer.encode(body.prompt, add_special_tokens=True)
    else:
        if any(t < 0 or t >= state.info.vocab_size for t in body.prompt):
            raise APIError(400, f"token ids must be in [0, {state.info.vocab_size})", param="prompt")
        prompt = list(body.prompt)
    state.check_prompt(len(prompt), "prompt")
    max_tokens = state.clamp_max_tokens(body.max_tokens or 16, len(prompt))
    sp = sampling_from(body, max_tokens, body.logprobs)
    sid = session_key(request.headers, body.model_dump())
    cid, created = new_id("cmpl"), int(time.time())
    events = generate(state, prompt, sp, sid, cid)
    base = {"id": cid, "object": "text_completion", "created": created, "model": state.model_name}
    if not body.stream:
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
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    first = await anext(events)

    async def stream() -> AsyncIterator[str]:
        usage, offset = Usage(), 0

        async def all_events() -> AsyncIterator[GenEvent]:
            yield first
            async for e in events:
                yield e

        try:
            async for ev in all_events():
                usage = ev.usage
                lp = _completion_logprobs(state, ev.logprobs, offset) if body.logprobs is not None and ev.logprobs else None
                offset += len(ev.text)
                if ev.text or ev.finished:
                    yield sse({**base, "choices": [{
                        "index": 0, "text": ev.text, "logprobs": lp,
                        "finish_reason": ev.finish_reason if ev.finished else None,
                    }]})
        finally:
            await events.aclose()
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage.openai()})
        yield sse("[DONE]")

    return StreamingResponse(stream(), media_type="text/event-stream")
