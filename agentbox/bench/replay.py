"""Replay a trace against any OpenAI-compatible server: every session at once, turn by turn.

Each turn sends the recorded conversation so far (every engine sees the same prompts), streams the answer
asking for exactly the recorded number of output tokens, then appends the recorded answer (not the
model's), waits the recorded tool time and goes on. Every request carries the session's `X-Session-Id`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from agentbox.bench.stats import TurnRecord
from agentbox.trace import Session


@dataclass(frozen=True)
class ReplayOptions:
    model: str | None = None  # None: the first model the server lists at /v1/models
    # Ask every engine to write the recorded length: max_tokens plus ignore_eos and min_tokens (vLLM,
    # SGLang, llama.cpp and agentbox accept them). Off for servers that reject unknown fields.
    force_length: bool = True
    temperature: float = 0.0
    request_timeout_s: float = 1800.0  # one turn, prefill included: long under heavy recomputation
    max_concurrency: int | None = None  # None: every session at once, as in the published study
    api_key: str | None = None


@dataclass(frozen=True)
class ReplayResult:
    records: list[TurnRecord]
    wall_s: float
    model: str


def api_base(url: str) -> str:
    """`http://host:port`, `.../` or `.../v1` → `.../v1`."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def total_turns(sessions: list[Session]) -> int:
    return sum(len(s.turns) for s in sessions)


async def discover_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError("the server lists no models at /v1/models; pass a model name")
    return str(data[0]["id"])


async def replay(
    sessions: list[Session],
    url: str,
    options: ReplayOptions = ReplayOptions(),
    on_turn: Callable[[TurnRecord], None] | None = None,
    start_turn: int = 0,
    run_tag: str | None = None,
) -> ReplayResult:
    """`start_turn`: skip each session's turns before it (the rest of a replay cut by a restart, under the
    same `run_tag`: the session ids of its first part)."""
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    limits = httpx.Limits(max_connections=max(len(sessions), 1) + 4)
    timeout = httpx.Timeout(options.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(
        base_url=api_base(url), headers=headers, timeout=timeout, limits=limits
    ) as client:
        model = options.model or await discover_model(client)
        run_tag = run_tag or uuid.uuid4().hex[:8]  # a fresh session id per run: run 2 is not run 1
        gate = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
        records: list[TurnRecord] = []
        t0 = time.perf_counter()

        async def one(session: Session) -> None:
            if gate is None:
                await _session(client, session, model, options, f"{session.id}-{run_tag}", t0, records, on_turn,
                               start_turn)
                return
            async with gate:
                await _session(client, session, model, options, f"{session.id}-{run_tag}", t0, records, on_turn,
                               start_turn)

        await asyncio.gather(*(one(s) for s in sessions))
        wall = time.perf_counter() - t0
    records.sort(key=lambda r: (r.session, r.turn))
    return ReplayResult(records=records, wall_s=wall, model=model)


async def _session(
    client: httpx.AsyncClient,
    session: Session,
    model: str,
    options: ReplayOptions,
    session_header: str,
    t0: float,
    records: list[TurnRecord],
    on_turn: Callable[[TurnRecord], None] | None,
    start_turn: int = 0,
) -> None:
    for i, (turn, messages) in enumerate(zip(session.turns, session.prompts(), strict=True)):
        if i < start_turn:
            continue
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": turn.output_tokens,
            "temperature": options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if session.prefix.tools:
            body["tools"] = session.prefix.tools
        if options.force_length:
            body["ignore_eos"] = True
            body["min_tokens"] = turn.output_tokens
        record = await _turn(client, body, {"X-Session-Id": session_header}, session.id, i, t0)
        records.append(record)
        if on_turn is not None:
            on_turn(record)
        if i + 1 < len(session.turns) and turn.wait_s > 0:
            await asyncio.sleep(turn.wait_s)  # the agent running its tool


async def _turn(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    headers: dict[str, str],
    session: str,
    turn: int,
    t0: float,
) -> TurnRecord:
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    chunks_with_text = 0
    end_seen: float | None = None
    try:
        async with client.stream("POST", "/chat/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if chunk.get("error"):
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    if _has_text(choice.get("delta") or {}):
                        chunks_with_text += 1
                        if ttft is None:
                            ttft = time.perf_counter() - start
                    elif choice.get("finish_reason") and ttft is None and end_seen is None:
                        end_seen = time.perf_counter() - start  # an answer with no text: EOS first
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as e:
        return TurnRecord(
            session,
            turn,
            start - t0,
            ttft,
            time.perf_counter() - start,
            0,
            None,
            0,
            error=f"{type(e).__name__}: {e}"[:400],
        )
    latency = time.perf_counter() - start
    if ttft is None:
        ttft = end_seen  # a server that ignored ignore_eos and stopped at once still took this long
    if usage is None:
        # stream_options.include_usage not honoured: the timings still count, the token counts do not
        return TurnRecord(session, turn, start - t0, ttft, latency, 0, None, chunks_with_text, usage=False)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return TurnRecord(
        session=session,
        turn=turn,
        start_s=start - t0,
        ttft_s=ttft,
        latency_s=latency,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(cached) if cached is not None else None,
        output_tokens=int(usage.get("completion_tokens") or 0),
    )


def _has_text(delta: dict[str, Any]) -> bool:
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


def replay_sync(
    sessions: list[Session],
    url: str,
    options: ReplayOptions = ReplayOptions(),
    on_turn: Callable[[TurnRecord], None] | None = None,
    start_turn: int = 0,
    run_tag: str | None = None,
) -> ReplayResult:
    return asyncio.run(replay(sessions, url, options, on_turn, start_turn, run_tag))
