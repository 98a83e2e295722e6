"""OpenAI Responses end to end: the official `openai` client streams a function-call round trip (forced by
tool_choice so SmolLM2 complies) against a real `agentbox serve`, checked event by event as Codex reads it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct.Q4_1"
pytestmark = pytest.mark.slow
SHELL = {"type": "function", "name": "shell", "description": "Run a shell command.",
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
                        "required": ["command"]}}
INPUT = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files here."}]}]


@pytest.fixture(scope="module")
def client(live_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0, timeout=180)


def test_streamed_function_call_round_trip(client: openai.OpenAI) -> None:
    stream = client.responses.create(model=MODEL, input=INPUT, instructions="You are Codex.", tools=[SHELL],
                                     tool_choice={"type": "function", "name": "shell"}, max_output_tokens=128,
                                     temperature=0, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    announced: set[str] = set()
    args = ""
    for e in events:
        if e.type == "response.output_item.added":
            announced.add(e.item.id)
        elif e.type.endswith(".delta"):
            assert e.item_id in announced  # output_item.added comes before any delta of its item
            if e.type == "response.function_call_arguments.delta":
                args += e.delta
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == args
    assert "response.output_item.done" in kinds
    done = events[-1].response
    assert done.id.startswith("resp_") and done.object == "response" and done.model == MODEL
    assert done.status == "completed"
    calls = [o for o in done.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "shell" and calls[0].status == "completed"
    assert isinstance(json.loads(calls[0].arguments)["command"], list)
    assert done.usage is not None and done.usage.input_tokens > 0
    assert done.usage.input_tokens_details.cached_tokens >= 0

    follow = [*INPUT, {"type": "function_call", "call_id": calls[0].call_id, "name": "shell",
                       "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "README.md\nsetup.py"}]
    r = client.responses.create(model=MODEL, input=follow, instructions="You are Codex.", tools=[SHELL],
                                tool_choice="none", max_output_tokens=12, temperature=0)
    assert r.status in ("completed", "incomplete") and r.object == "response"
    assert [o.type for o in r.output] == ["message"] and r.output_text
    assert r.usage is not None and r.usage.input_tokens > done.usage.input_tokens


def test_string_input_and_refusals(client: openai.OpenAI, live_server: str) -> None:
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage is not None and r.usage.output_tokens == 4
    bad = httpx.post(live_server + "/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "r"},
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "previous_response_id"
