"""Tool calls and reasoning on /v1/chat/completions: the shared output pipeline split at every position,
then the real server (SmolLM2 under constrained decoding) through the official openai client, and
`agentbox check tools` against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from agentbox.chat.tool_parsers import Delta
from agentbox.server.chat_pipeline import OutputProcessor, fold

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}


# ---- the output pipeline, no server ------------------------------------------------------------------
THOUGHT = 'I could write <tool_call>\n{"name": "ping", "arguments": {"x": 1}}\n</tool_call> here'
OUTPUT = (THOUGHT + '</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')


def _run(pieces: list[str]) -> tuple[list[Delta], OutputProcessor]:
    proc = OutputProcessor("qwen3", True, "hermes", [WEATHER, PING])
    deltas = [d for p in pieces for d in proc.feed(p)] + proc.finish()
    return deltas, proc


def test_reasoning_never_reaches_content_or_arguments_at_any_split() -> None:
    whole, proc = _run([OUTPUT])
    expected = fold(whole)
    assert expected.reasoning == THOUGHT  # the call written while thinking stays reasoning
    assert expected.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in expected.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("ping", {})]
    assert proc.finish_reason("stop") == "tool_calls" and proc.finish_reason("length") == "length"
    for cut in range(1, len(OUTPUT)):
        got = fold(_run([OUTPUT[:cut], OUTPUT[cut:]])[0])
        assert (got.reasoning, got.content) == (expected.reasoning, expected.content), cut
        assert [(c.name, c.arguments) for c in got.tool_calls] == [(c.name, c.arguments) for c in expected.tool_calls]


def test_no_tools_means_no_parsing_and_plain_finish() -> None:
    proc = OutputProcessor("none", False, None, None)
    text = 'Use <tool_call>{"name": "x"}</tool_call> like this.'
    out = fold(proc.feed(text) + proc.finish())
    assert out.content == text and not out.tool_calls and proc.finish_reason("stop") == "stop"


# ---- the live server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(live_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0, timeout=180)


MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.slow
def test_forced_zero_argument_call_non_streaming(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER, PING], max_tokens=128,
                                       tool_choice={"type": "function", "function": {"name": "ping"}}, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    (call,) = ch.message.tool_calls or []
    assert call.function.name == "ping" and json.loads(call.function.arguments) == {}
    assert call.id.startswith("call_")
    assert r.usage is not None and r.usage.prompt_tokens_details is not None


@pytest.mark.slow
def test_streamed_call_shape_then_results_round_trip(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=[WEATHER, PING], max_tokens=128, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    firsts, args, finish = [], "", None
    for chunk in stream:
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        for tc in ch.delta.tool_calls or []:
            assert tc.index == 0
            if tc.id is not None:
                firsts.append((tc.id, tc.function.name))
            args += tc.function.arguments or ""
    assert finish == "tool_calls"
    assert len(firsts) == 1 and firsts[0][1] == "get_weather"  # id and name once, on the first delta
    parsed = json.loads(args)
    assert isinstance(parsed["city"], str) and parsed["unit"] in ("c", "f")

    history = [*MSGS, {"role": "assistant", "content": None, "reasoning_content": "The user wants weather.",
                       "tool_calls": [{"id": firsts[0][0], "type": "function",
                                       "function": {"name": "get_weather", "arguments": args}}]},
               {"role": "tool", "tool_call_id": firsts[0][0], "content": "18 C, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, PING], max_tokens=12,
                                       temperature=0, extra_body={"structured_tool_calls": False})
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content


@pytest.mark.slow
def test_tool_choice_naming_an_unknown_tool_is_400(live_server: str) -> None:
    body = {"model": MODEL, "messages": MSGS, "tools": [PING],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    r = httpx.post(live_server + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = httpx.post(live_server + "/v1/chat/completions", json={**body, "tool_choice": "required", "tools": None},
                   timeout=30)
    assert r.status_code == 400


@pytest.mark.slow
def test_check_tools_command_passes(live_server: str, agentbox_home: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "agentbox.cli.main", "check", "tools", "--url", live_server],
                       env={**os.environ, "AGENTBOX_HOME": str(agentbox_home), "COLUMNS": "200"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("pass") == 5 and "FAIL" not in r.stdout


@pytest.mark.slow
def test_check_tools_fails_against_no_server(agentbox_home: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "agentbox.cli.main", "check", "tools", "--url", "http://127.0.0.1:9"],
                       env={**os.environ, "AGENTBOX_HOME": str(agentbox_home), "COLUMNS": "200"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "FAIL" in r.stdout
