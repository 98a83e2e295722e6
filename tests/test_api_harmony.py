"""gpt-oss's harmony output through the real server and the official clients, on every API, streaming and
not: a scripted checkpoint (tests/scripted_model.py) replays a recorded gpt-oss output token by token through
the real engine; the server must turn it into reasoning, content and tool calls for OpenAI chat, Responses
and Anthropic messages alike. The script also writes `<|end|>` as its special token mid-turn, which must
not end the turn (harmony ends turns with `<|return|>` / `<|call|>`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from scripted_model import serving_scripted, write_scripted_model

FIXTURES = Path(__file__).parent / "fixtures" / "harmony"
TEMPLATE = (FIXTURES / "gpt-oss-chat_template.jinja").read_text()
SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
SCRIPTS = {
    "final": ("<|channel|>analysis<|message|>Easy sum.<|end|><|start|>assistant<|channel|>final<|message|>Four.",
              "<|return|>"),
    "tool": ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
             'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', "<|call|>"),
}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": SCHEMA}}


pytestmark = pytest.mark.slow  # two real servers (about 20 s each to start on a shared CPU)



@pytest.fixture(scope="module", params=list(SCRIPTS))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    model = tmp_path_factory.mktemp(f"scripted-{request.param}")
    write_scripted_model(model, *SCRIPTS[request.param], SPECIAL, TEMPLATE)
    with serving_scripted(model, tmp_path_factory.mktemp("home")) as url:
        yield request.param, url


def _model(base: str) -> str:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x").models.list().data[0].id


def test_openai_chat(server: tuple[str, str]) -> None:
    kind, base = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
    kw = dict(model=_model(base), messages=[{"role": "user", "content": "Weather in Paris? Or 2+2?"}],
              tools=[OPENAI_TOOL] if kind == "tool" else openai.NOT_GIVEN, max_tokens=200)
    r = client.chat.completions.create(**kw)
    msg, choice = r.choices[0].message, r.choices[0]
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    chunks = list(client.chat.completions.create(**kw, stream=True))
    s_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    s_reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                          for c in chunks if c.choices)
    s_args = "".join(tc.function.arguments or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or [])
    s_names = [tc.function.name for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or [] if tc.function.name]
    s_finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if kind == "final":
        assert (msg.content, reasoning, choice.finish_reason) == ("Four.", "Easy sum.", "stop")
        assert (s_content, s_reasoning, s_finish) == ("Four.", "Easy sum.", ["stop"])
    else:
        assert reasoning == "Need the weather." and not msg.content and choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        assert (s_reasoning, s_names, json.loads(s_args), s_finish) == (
            "Need the weather.", ["get_weather"], {"city": "Paris"}, ["tool_calls"])
        assert not s_content


def test_openai_responses(server: tuple[str, str]) -> None:
    kind, base = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
    tools = [{"type": "function", "name": "get_weather", "description": "Weather.", "parameters": SCHEMA}]
    kw = dict(model=_model(base), input="Weather in Paris? Or 2+2?", max_output_tokens=200,
              tools=tools if kind == "tool" else openai.NOT_GIVEN)
    r = client.responses.create(**kw)
    streamed = [e for e in client.responses.create(**kw, stream=True)]
    done = next(e for e in streamed if e.type == "response.completed").response
    for resp in (r, done):
        types = [item.type for item in resp.output]
        if kind == "final":
            assert types == ["reasoning", "message"] and resp.output_text == "Four."
            assert resp.output[0].content[0].text == "Easy sum."
        else:
            assert types == ["reasoning", "function_call"]
            call = resp.output[1]
            assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    if kind == "final":
        assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == "Four."


def test_anthropic_messages(server: tuple[str, str]) -> None:
    kind, base = server
    client = anthropic.Anthropic(base_url=base, api_key="x")
    tools = [{"name": "get_weather", "description": "Weather.", "input_schema": SCHEMA}]
    kw = dict(model=_model(base), max_tokens=200, messages=[{"role": "user", "content": "Weather in Paris? Or 2+2?"}],
              tools=tools if kind == "tool" else anthropic.NOT_GIVEN)
    r = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    for msg in (r, final):
        blocks = {b.type: b for b in msg.content}
        assert blocks["thinking"].thinking == ("Easy sum." if kind == "final" else "Need the weather.")
        if kind == "final":
            assert blocks["text"].text == "Four." and msg.stop_reason == "end_turn"
        else:
            assert msg.stop_reason == "tool_use" and "text" not in blocks
            assert (blocks["tool_use"].name, blocks["tool_use"].input) == ("get_weather", {"city": "Paris"})


def test_reasoning_effort_on_every_api_and_bad_values_name_their_field(server: tuple[str, str]) -> None:
    """Each API's effort field is accepted by the real server (the template renders it: test_chat_harmony.py
    checks the text); a value outside the API's set is a 400 naming the field, and the server keeps serving."""
    kind, base = server
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    model, user = _model(base), [{"role": "user", "content": "2+2?"}]
    with pytest.raises(openai.BadRequestError) as bad_chat:
        oa.chat.completions.create(model=model, messages=user, max_tokens=50, reasoning_effort="extreme")  # type: ignore[arg-type]
    assert bad_chat.value.body["param"] == "reasoning_effort"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad_responses:
        oa.responses.create(model=model, input="2+2?", max_output_tokens=50, reasoning={"effort": "max"})  # type: ignore[typeddict-item]
    assert bad_responses.value.body["param"] == "reasoning.effort"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match=r"output_config\.effort"):
        an.messages.create(model=model, max_tokens=50, messages=user, extra_body={"output_config": {"effort": "none"}})
    chat = oa.chat.completions.create(model=model, messages=user, max_tokens=200, reasoning_effort="high")
    resp = oa.responses.create(model=model, input="2+2?", max_output_tokens=200, reasoning={"effort": "low"})
    msg = an.messages.create(model=model, max_tokens=200, messages=user, extra_body={"output_config": {"effort": "max"}})
    assert resp.status == "completed" and msg.content and chat.choices[0].message.model_extra
    if kind == "final":
        assert (chat.choices[0].message.content, resp.output_text) == ("Four.", "Four.")
        assert msg.stop_reason == "end_turn"
