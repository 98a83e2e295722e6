"""GLM-4.7's output through the real server and the official clients, on every API, streamed and not: a scripted
checkpoint (tests/scripted_model.py) replays a recorded GLM-4.7 turn token by token through the real engine. The
turn is an empty thinking block written as `</think>` alone (the template opened `<think>`), then two calls in
GLM-4.7's syntax without newlines, the first with zero arguments (`<tool_call>list_files</tool_call>`: vLLM's
parser crashes on it, vllm#32436). The server must report no reasoning, no content and both calls."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest
from glm_template import SPECIAL, TEMPLATE
from scripted_model import serving_scripted, write_scripted_model

SCRIPT = "</think><tool_call>list_files</tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
NOTHING = {"type": "object", "properties": {}}
CALLS = [("list_files", {}), ("get_weather", {"city": "Paris"})]
QUESTION = "Files here, and the weather in Paris?"

pytestmark = pytest.mark.slow  # one real server (about 15 s to start on a shared CPU)



@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = tmp_path_factory.mktemp("scripted-glm")
    write_scripted_model(model, SCRIPT, "<|observation|>", SPECIAL, TEMPLATE, after="<think>")
    with serving_scripted(model, tmp_path_factory.mktemp("home")) as url:
        yield url


def _model(base: str) -> str:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x").models.list().data[0].id


def test_openai_chat(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
    tools = [{"type": "function", "function": {"name": "list_files", "description": "List.", "parameters": NOTHING}},
             {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}}]
    kw = dict(model=_model(base), messages=[{"role": "user", "content": QUESTION}], tools=tools, max_tokens=200)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert not msg.content and not (msg.model_extra or {}).get("reasoning_content")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == CALLS
    assert r.choices[0].finish_reason == "tool_calls"
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for tc in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", ""])
            entry[0] += tc.function.name or ""
            entry[1] += tc.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in calls.values()] == CALLS
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert not "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_openai_responses(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
    tools = [{"type": "function", "name": "list_files", "description": "List.", "parameters": NOTHING},
             {"type": "function", "name": "get_weather", "description": "Weather.", "parameters": WEATHER}]
    kw = dict(model=_model(base), input=QUESTION, max_output_tokens=200, tools=tools)
    r = client.responses.create(**kw)
    done = next(e for e in client.responses.create(**kw, stream=True) if e.type == "response.completed").response
    for resp in (r, done):
        calls = [(i.name, json.loads(i.arguments)) for i in resp.output if i.type == "function_call"]
        assert calls == CALLS and not resp.output_text
        assert all(not getattr(i, "content", None) for i in resp.output if i.type == "reasoning")


def test_anthropic_messages(base: str) -> None:
    client = anthropic.Anthropic(base_url=base, api_key="x")
    tools = [{"name": "list_files", "description": "List.", "input_schema": NOTHING},
             {"name": "get_weather", "description": "Weather.", "input_schema": WEATHER}]
    kw = dict(model=_model(base), max_tokens=200, messages=[{"role": "user", "content": QUESTION}], tools=tools)
    r = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    for msg in (r, final):
        assert [(b.name, b.input) for b in msg.content if b.type == "tool_use"] == CALLS
        assert not [b for b in msg.content if b.type == "text" and b.text]
        assert all(not b.thinking for b in msg.content if b.type == "thinking")
        assert msg.stop_reason == "tool_use"
