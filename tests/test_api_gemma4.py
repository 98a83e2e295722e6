"""Gemma 4's output through the real server and the official clients, on every API, streaming and not: a
scripted checkpoint (tests/scripted_model.py) with our own template reproducing Gemma 4's chat format (tests/data/,
not the released file) replays a recorded-style Gemma 4 answer (text, then
`<|tool_call>call:get_weather{...}<tool_call|>` with a `<|"|>`-quoted string and a bare number) token by token;
every API must return the text and one get_weather call with typed arguments. Thinking is off (the template's
default: it closes an empty thought channel at the prompt's end)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from scripted_model import serving_scripted, write_scripted_model

TEMPLATE = (Path(__file__).parent / "data" / "gemma4_format_chat_template.jinja").read_text()
# `<channel|>` stays a plain word: it is the prompt's last token, which the script continues from
SPECIAL = ["<|turn>", "<turn|>", "<|channel>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool>", "<tool|>"]
OUTPUT = 'Checking the forecast.<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3}<tool_call|>'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
CALL = ("get_weather", {"city": "Paris, FR", "days": 3})
TEXT = "Checking the forecast."
USER = "Weather in Paris for 3 days?"

pytestmark = pytest.mark.slow  # one real server (about 15 s to start on a shared CPU)



@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = tmp_path_factory.mktemp("scripted-gemma4")
    write_scripted_model(model, OUTPUT, "<turn|>", SPECIAL, TEMPLATE, after="<channel|>")
    with serving_scripted(model, tmp_path_factory.mktemp("home")) as url:
        yield url


def test_every_api_reads_gemma4_calls(base: str) -> None:
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
    model = oa.models.list().data[0].id
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": SCHEMA}}
    kw = dict(model=model, messages=[{"role": "user", "content": USER}], tools=[tool], max_tokens=200)
    r = oa.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert (msg.content, r.choices[0].finish_reason) == (TEXT, "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [CALL]
    chunks = [c for c in oa.chat.completions.create(**kw, stream=True) if c.choices]
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEXT
    assert ([tc.function.name for tc in calls if tc.function.name], json.loads("".join(
        tc.function.arguments or "" for tc in calls))) == (["get_weather"], CALL[1])

    tools = [{"type": "function", "name": "get_weather", "description": "Weather.", "parameters": SCHEMA}]
    rkw = dict(model=model, input=USER, max_output_tokens=200, tools=tools)
    done = next(e for e in oa.responses.create(**rkw, stream=True) if e.type == "response.completed").response
    for resp in (oa.responses.create(**rkw), done):
        assert [i.type for i in resp.output] == ["message", "function_call"] and resp.output_text == TEXT
        assert (resp.output[1].name, json.loads(resp.output[1].arguments)) == CALL

    an = anthropic.Anthropic(base_url=base, api_key="x")
    akw = dict(model=model, max_tokens=200, messages=[{"role": "user", "content": USER}],
               tools=[{"name": "get_weather", "description": "Weather.", "input_schema": SCHEMA}])
    with an.messages.stream(**akw) as stream:
        final = stream.get_final_message()
    for m in (an.messages.create(**akw), final):
        blocks = {b.type: b for b in m.content}
        assert m.stop_reason == "tool_use" and blocks["text"].text == TEXT
        assert (blocks["tool_use"].name, blocks["tool_use"].input) == CALL
