"""The replayer and the comparison against a small reference OpenAI-compatible server on a loopback port.

The reference server stands in for "any OpenAI-compatible server" (an external contract, not one of our
components): it counts words as tokens, streams exactly max_tokens chunks, and reports as cached the
previous prompt of the same X-Session-Id (a perfect session cache), so every count is known in advance.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from typer.testing import CliRunner

from agentbox import trace
from agentbox.bench import synth
from agentbox.bench.replay import ReplayOptions, replay_sync
from agentbox.bench.spawn import Target, free_port, run_targets
from agentbox.bench.stats import summarize
from agentbox.cli.main import app as cli_app


def _words(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "").split()) for m in messages)


def make_reference_app(seen: list[dict[str, Any]], llama_like: bool = False) -> FastAPI:
    """llama_like: behave as llama-cpp-python's server does, no usage in the stream and (with a model that
    ignores ignore_eos) an immediate stop with no text."""
    api = FastAPI()
    last_prompt: dict[str, int] = {}

    @api.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "ref-model", "object": "model"}]}

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        sid = request.headers.get("x-session-id", "")
        seen.append({"session": sid, "body": body})
        prompt = _words(body["messages"])
        cached = last_prompt.get(sid, 0)
        last_prompt[sid] = prompt
        n = int(body["max_tokens"])

        def events() -> Iterator[str]:
            base = {"id": "c", "object": "chat.completion.chunk", "model": "ref-model"}
            yield (
                "data: "
                + json.dumps({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                + "\n\n"
            )
            if llama_like:
                end = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
                yield "data: " + json.dumps(end) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            for _ in range(n):
                yield (
                    "data: "
                    + json.dumps({**base, "choices": [{"index": 0, "delta": {"content": "tok "}}]})
                    + "\n\n"
                )
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": n,
                "total_tokens": prompt + n,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            yield "data: " + json.dumps({**base, "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return api


@pytest.fixture
def reference_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(make_reference_app(seen), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "reference server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(timeout=10)


SESSIONS = synth.generate(synth.SynthConfig(sessions=3, turns=4, turn_sigma=0.0, scale=0.05, wait=0.05))


def test_replay_sends_recorded_prompts_and_counts_add_up(reference_server: tuple[str, list]) -> None:
    url, seen = reference_server
    result = replay_sync(SESSIONS, url)
    assert result.model == "ref-model" and len(result.records) == 12
    assert all(r.ok and r.ttft_s is not None and r.ttft_s <= r.latency_s for r in result.records)
    # every request: the recorded conversation so far, the recorded length, the session header
    by_session: dict[str, list[dict[str, Any]]] = {}
    for req in seen:
        by_session.setdefault(req["session"], []).append(req["body"])
    assert len(by_session) == 3
    for session in SESSIONS:
        (bodies,) = [b for sid, b in by_session.items() if sid.startswith(session.id + "-")]
        assert [b["messages"] for b in bodies] == list(session.prompts())
        for body, turn in zip(bodies, session.turns, strict=True):
            assert (
                body["max_tokens"] == body["min_tokens"] == turn.output_tokens and body["ignore_eos"] is True
            )
            assert body["stream"] and body["stream_options"] == {"include_usage": True}
            assert body["tools"] == session.prefix.tools and body["model"] == "ref-model"
    # counts: what the server reported, turn by turn
    for r in result.records:
        (session,) = [s for s in SESSIONS if s.id == r.session]
        prompt = list(session.prompts())[r.turn]
        assert r.prompt_tokens == _words(prompt) and r.output_tokens == session.turns[r.turn].output_tokens
    stats = summarize("ref", result.records, result.wall_s)
    # the reference server caches each session's previous prompt: the history, so nothing is recomputed
    history = sum(r.prompt_tokens for r in result.records if r.turn < 3)
    assert stats.history_tokens == history and stats.recomputed_tokens == 0 and stats.recomputed_share == 0.0
    assert stats.cached_tokens == sum(r.prompt_tokens for r in result.records if r.turn < 3)


def test_errors_are_recorded_and_the_run_goes_on(reference_server: tuple[str, list]) -> None:
    url, _ = reference_server
    result = replay_sync(SESSIONS[:1], url, ReplayOptions(model="ref-model"))
    assert all(r.ok for r in result.records)
    bad = replay_sync(SESSIONS[:1], url + "/nope", ReplayOptions(model="m"))
    assert len(bad.records) == 4 and all(r.error and "404" in r.error for r in bad.records)


def test_cli_comparison_writes_table_json_and_plot(
    reference_server: tuple[str, list], tmp_path: Path
) -> None:
    url, _ = reference_server
    out = tmp_path / "out"
    saved = tmp_path / "trace.jsonl"
    res = CliRunner().invoke(
        cli_app,
        [
            "bench",
            "replay",
            "--synthetic",
            "--sessions",
            "2",
            "--turns",
            "3",
            "--scale",
            "0.05",
            "--wait",
            "0.01",
            "--target",
            f"a={url}",
            "--target",
            f"b={url}",
            "--out",
            str(out),
            "--save-trace",
            str(saved),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "agent trace replay" in res.output  # the table's title (columns wrap at 80 characters)
    doc = json.loads((out / "replay.json").read_text())
    assert [r["stats"]["name"] for r in doc["runs"]] == ["a", "b"]
    n_turns = sum(len(s.turns) for s in trace.load(saved))
    assert all(
        r["stats"]["turns"] == n_turns == len(r["turns"]) and r["stats"]["errors"] == 0 for r in doc["runs"]
    )
    assert doc["meta"]["command"].startswith("agentbox") and doc["meta"]["synth"]["sessions"] == 2
    assert (out / "ttft_by_turn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_target_that_cannot_start_becomes_a_note(tmp_path: Path) -> None:
    notes: list[str] = []
    dead = Target(name="dead", command=["python", "-c", "raise SystemExit(3)"], ready_paths=("/health",))
    missing = Target(name="llama.cpp", note="llama_cpp is not importable")
    assert run_targets(SESSIONS[:1], [dead, missing], ReplayOptions(model="m"), tmp_path, notes=notes) == []
    assert "dead: failed, server exited with 3" in notes[0] and "llama.cpp: skipped" in notes[1]
    assert (tmp_path / "dead.log").exists()


def test_flattened_trace_replays_the_same_way(reference_server: tuple[str, list]) -> None:
    url, seen = reference_server
    flat = trace.flatten_tools(SESSIONS[:1])
    result = replay_sync(flat, url)
    assert all(r.ok for r in result.records) and "tools" not in seen[0]["body"]


def test_a_server_without_usage_still_gets_timed() -> None:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            make_reference_app([], llama_like=True), host="127.0.0.1", port=port, log_level="error"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        result = replay_sync(SESSIONS[:1], f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert all(r.ok and not r.usage and r.ttft_s is not None and r.output_tokens == 0 for r in result.records)
    stats = summarize("llama-like", result.records, result.wall_s)
    assert stats.turns_without_usage == 4 and stats.recomputed_share is None and stats.ttft_p50_s is not None
