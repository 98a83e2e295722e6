"""Qwen3.8's released chat template behind the real server and the official clients: a scripted checkpoint
(tests/scripted_model.py) replays a Qwen3.8-shaped turn (reasoning after the prompt's `<think>`, then two XML
calls, one with `<` in a value, one with nested JSON) through the real engine. A Claude Code-shaped Anthropic
request (a late system message, a turn of tool results only) and an OpenAI chat request with a late system
message render and answer: reasoning split off, both calls read back with the arguments written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from scripted_model import serving_scripted, write_scripted_model

TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3_8" / "chat_template.jinja").read_text()
SPECIAL = ["<|im_start|>", "<|im_end|>"]
REASONING = "The check is off by one; fix it and note the todo."
SCRIPT = (REASONING + "\n</think>\n\n<tool_call>\n<function=Edit>\n<parameter=file_path>\n/repo/a.py\n</parameter>\n"
          "<parameter=old_string>\nif a<b:\n</parameter>\n<parameter=new_string>\nif a <= b:\n</parameter>\n"
          "</function>\n</tool_call>\n<tool_call>\n<function=TodoWrite>\n<parameter=todos>\n"
          '[{"content": "x<y", "status": "pending"}]\n</parameter>\n</function>\n</tool_call>')
EDIT = {"type": "object", "properties": {"file_path": {"type": "string"}, "old_string": {"type": "string"},
                                         "new_string": {"type": "string"}},
        "required": ["file_path", "old_string", "new_string"]}
TODO = {"type": "object", "properties": {"todos": {"type": "array", "items": {"type": "object", "properties": {
    "content": {"type": "string"}, "status": {"type": "string"}}}}}, "required": ["todos"]}
CALLS = [("Edit", {"file_path": "/repo/a.py", "old_string": "if a<b:", "new_string": "if a <= b:"}),
         ("TodoWrite", {"todos": [{"content": "x<y", "status": "pending"}]})]

pytestmark = pytest.mark.slow  # one real server (about 15 s to start on a shared CPU)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # The directory's name matches profiles/qwen3.8-27b.toml: its parser, effort and sampling defaults apply.
    model = tmp_path_factory.mktemp("scripted") / "Qwen3.8-27B-scripted"
    model.mkdir()
    write_scripted_model(model, SCRIPT, "<|im_end|>", SPECIAL, TEMPLATE, after="<think>")
    with serving_scripted(model, tmp_path_factory.mktemp("home")) as url:
        yield url


def _model(base: str) -> str:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x").models.list().data[0].id


def test_claude_code_request_with_a_late_system_message_and_a_tool_only_turn(base: str) -> None:
    client = anthropic.Anthropic(base_url=base, api_key="x")
    tools = [{"name": "Edit", "description": "Edit a file.", "input_schema": EDIT},
             {"name": "TodoWrite", "description": "Write todos.", "input_schema": TODO}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Fix the off-by-one in a.py."}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Read it first.", "signature": "x"},
            {"type": "tool_use", "id": "t1", "name": "Edit", "input": {"file_path": "/repo/a.py", "old_string": "",
                                                                       "new_string": ""}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "no match"}]},
        {"role": "system", "content": "<system-reminder>The todo list is empty.</system-reminder>"},
    ]
    kw = dict(model=_model(base), max_tokens=300, system="You are Claude Code.", messages=messages, tools=tools)
    r = client.messages.create(**kw)  # type: ignore[arg-type]
    with client.messages.stream(**kw) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    for msg in (r, final):
        assert [(b.name, b.input) for b in msg.content if b.type == "tool_use"] == CALLS
        assert [b.thinking.strip() for b in msg.content if b.type == "thinking"] == [REASONING]
        assert not [b for b in msg.content if b.type == "text" and b.text.strip()]
        assert msg.stop_reason == "tool_use"


def test_openai_chat_with_a_late_system_message(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
    tools = [{"type": "function", "function": {"name": "Edit", "description": "Edit.", "parameters": EDIT}},
             {"type": "function", "function": {"name": "TodoWrite", "description": "Todos.", "parameters": TODO}}]
    messages = [{"role": "system", "content": "You are opencode."}, {"role": "user", "content": "Fix a.py."},
                {"role": "system", "content": "Context was compacted."}]
    r = client.chat.completions.create(model=_model(base), messages=messages, tools=tools, max_tokens=300,
                                       reasoning_effort="high")  # reaches the template as its xhigh
    msg = r.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == CALLS
    assert (msg.model_extra or {}).get("reasoning_content", "").strip() == REASONING
    assert r.choices[0].finish_reason == "tool_calls"
