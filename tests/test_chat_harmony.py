"""Harmony (gpt-oss): recorded outputs split into reasoning, content and tool calls at every stream split,
the same folded result non-streaming; the OpenAI chat message and Responses items built from them; the
gpt-oss chat template renders reasoning, one call per message with its own result, and the generation
prompt; the template is recognised (parser "openai", reasoning "harmony") and special tokens are kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from agentbox.chat.harmony import HarmonySplitter, keeps_special_tokens, prepare_messages
from agentbox.chat.render import render_prompt
from agentbox.chat.tool_parsers import detect_tool_parser, get_tool_parser
from agentbox.server.chat_pipeline import OutputProcessor, fold, reasoning_style_of
from agentbox.server.detok import Detokenizer
from agentbox.server.openai_routes import _message
from agentbox.server.responses_routes import OutputBuilder

FIXTURES = Path(__file__).parent / "fixtures" / "harmony"
CASES = json.loads((FIXTURES / "outputs.json").read_text())["cases"]
TEMPLATE = (FIXTURES / "gpt-oss-chat_template.jinja").read_text()
SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}


def run(pieces: list[str], tools: bool = True) -> tuple[list, OutputProcessor]:
    proc = OutputProcessor("harmony", False, "openai" if tools else None, [WEATHER, PING] if tools else None)
    return [d for p in pieces for d in proc.feed(p)] + proc.finish(), proc


def summary(deltas: list) -> tuple[str, str, list]:
    out = fold(deltas)
    return out.reasoning, out.content, [[c.name, json.loads(c.arguments)] for c in out.tool_calls]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_recorded_output_splits_the_same_at_every_position(case: dict) -> None:
    text = case["text"]
    whole, proc = run([text])
    assert summary(whole) == (case["reasoning"], case["content"], case["calls"])
    assert proc.finish_reason("stop") == ("tool_calls" if case["calls"] else "stop")
    for cut in range(1, len(text)):
        assert summary(run([text[:cut], text[cut:]])[0]) == summary(whole), cut
    chars, _ = run(list(text))  # one character at a time: no markup may leak into any piece
    assert summary(chars) == summary(whole)
    for d in chars:
        for piece in (d.content, d.reasoning, d.tool_call and d.tool_call.arguments):
            assert not piece or not any(tag in piece for tag in SPECIAL), piece


def test_without_tools_reasoning_is_still_split() -> None:
    case = CASES[0]
    assert summary(run([case["text"]], tools=False)[0]) == (case["reasoning"], case["content"], [])
    assert HarmonySplitter().split(case["text"]) == (case["reasoning"], case["content"])


def test_openai_chat_message_and_responses_items() -> None:
    deltas, _ = run([CASES[1]["text"]])
    msg = _message(fold(deltas))
    assert msg["reasoning_content"] == CASES[1]["reasoning"] and msg["content"] is None
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    builder = OutputBuilder()
    events = [e for d in run(list(CASES[2]["text"]))[0] for e in builder.feed(d)] + builder.close()
    assert [i["type"] for i in builder.items] == ["reasoning", "message", "function_call"]
    assert builder.items[1]["content"][0]["text"] == "Let me check the server."
    assert builder.items[2]["name"] == "ping" and builder.items[2]["arguments"] == "{}"
    assert events[-1]["type"] == "response.output_item.done"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    words = ["[UNK]", "assistant", "final", "analysis", "hi", "there"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL})
    fast.chat_template = TEMPLATE
    return fast


def test_template_is_recognised(tokenizer: PreTrainedTokenizerFast) -> None:
    assert detect_tool_parser(TEMPLATE) == "openai" and reasoning_style_of(TEMPLATE) == "harmony"
    assert get_tool_parser("gpt_oss").name == "openai"
    assert keeps_special_tokens(tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["<|channel|>", "final", "<|message|>", "hi", "<|return|>"])
    kept = Detokenizer(tokenizer, skip_special_tokens=False).add(ids)
    assert "<|channel|>" in kept and "<|message|>" in kept
    assert "<|channel|>" not in Detokenizer(tokenizer).add(ids)


def test_render_reasoning_and_parallel_calls_each_with_its_result(tokenizer: PreTrainedTokenizerFast) -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris? Also ping."},
        {"role": "assistant", "content": "", "reasoning_content": "Two tools.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c2", "content": "pong"},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ]
    text = render_prompt(tokenizer, messages, [WEATHER, PING])
    assert text.startswith("<|start|>system<|message|>") and text.endswith("<|start|>assistant")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "<|start|>assistant<|channel|>analysis<|message|>Two tools.<|end|>" in text
    expected = ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
                '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18C"<|end|>'
                "<|start|>assistant to=functions.ping<|channel|>commentary json<|message|>{}<|call|>"
                '<|start|>functions.ping to=assistant<|channel|>commentary<|message|>"pong"<|end|>')
    assert expected in text
    assert text == render_prompt(tokenizer, messages, [WEATHER, PING])  # stable across turns


def test_prepare_messages_is_pure_and_keeps_unmatched_results() -> None:
    calls = [{"id": "a", "function": {"name": "x", "arguments": {}}}, {"id": "b", "function": {"name": "y", "arguments": {}}}]
    messages = [{"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "b", "content": "B"}, {"role": "tool", "tool_call_id": "zz", "content": "?"}]
    out = prepare_messages(messages)
    assert [(m["role"], m.get("content")) for m in out] == [
        ("assistant", ""), ("assistant", ""), ("tool", "B"), ("tool", "?")]
    assert messages[0]["tool_calls"] == calls and len(messages) == 3  # input untouched


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b", "Qwen3-Coder-30B-A3B-Instruct"])
def test_moe_profiles_name_what_exists(name: str) -> None:
    from agentbox.chat.reasoning import get_reasoning_splitter
    from agentbox.hub.engine_support import engine_runs
    from agentbox.hub.profiles import find_profile
    from agentbox.models.registry import MODEL_REGISTRY

    prof = find_profile(name)
    assert prof.architecture in MODEL_REGISTRY and engine_runs(prof)
    assert get_tool_parser(prof.tool_parser).name in ("openai", "qwen3_coder")
    splitter = get_reasoning_splitter(prof.reasoning_parser or None)
    assert isinstance(splitter, HarmonySplitter) == name.startswith("gpt-oss")
    assert prof.active_params < prof.params


EFFORT_CASES = [  # (API, effort as that API sends it, the level gpt-oss's system message must carry)
    ("chat", None, "medium"), ("chat", "high", "high"), ("chat", "low", "low"), ("chat", "none", "low"),
    ("responses", "high", "high"), ("responses", "minimal", "low"), ("responses", "xhigh", "high"),
    ("anthropic", "medium", "medium"), ("anthropic", "max", "high"), ("anthropic", None, "medium"),
]


def _conversation(api: str, effort: str | None) -> object:
    """The request as each API's route reads it (its body model and its own translation)."""
    from agentbox.server import anthropic_routes, openai_routes, responses_routes
    from agentbox.server.protocol import ChatCompletionRequest

    user = [{"role": "user", "content": "hi"}]
    if api == "chat":
        body = ChatCompletionRequest(model="m", messages=user, **({"reasoning_effort": effort} if effort else {}))
        return openai_routes.conversation_of(body)
    if api == "responses":
        req = responses_routes.ResponsesRequest(model="m", input="hi", reasoning={"effort": effort, "summary": "auto"})
        return responses_routes.conversation_of(req)
    extra = {"output_config": {"effort": effort}} if effort else {}
    return anthropic_routes.conversation_of(anthropic_routes.MessagesBody(model="m", messages=user, **extra))


@pytest.mark.parametrize(("api", "effort", "level"), EFFORT_CASES)
def test_reasoning_effort_reaches_the_system_message(
    tokenizer: PreTrainedTokenizerFast, api: str, effort: str | None, level: str
) -> None:
    conv = _conversation(api, effort)
    text = render_prompt(tokenizer, conv.messages, conv.tools, enable_thinking=conv.enable_thinking,  # type: ignore[attr-defined]
                         reasoning_effort=conv.reasoning_effort)  # type: ignore[attr-defined]
    system = text[: text.index("<|end|>")]
    assert system.startswith("<|start|>system<|message|>")
    assert f"\nReasoning: {level}\n" in system and system.count("Reasoning:") == 1
    # templates with an on/off switch (Qwen3) still read none / minimal as off
    assert conv.enable_thinking is (False if effort in ("none", "minimal") else None)  # type: ignore[attr-defined]


def test_bad_reasoning_effort_is_refused_naming_its_field() -> None:
    from pydantic import ValidationError

    from agentbox.server import anthropic_routes, responses_routes
    from agentbox.server.errors import APIError
    from agentbox.server.protocol import ChatCompletionRequest

    with pytest.raises(ValidationError, match="reasoning_effort"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], reasoning_effort="max")
    with pytest.raises(ValidationError, match=r"reasoning\.effort"):
        responses_routes.ResponsesRequest(model="m", input="hi", reasoning={"effort": "extreme"})
    body = anthropic_routes.MessagesBody(model="m", messages=[{"role": "user", "content": "hi"}],
                                         output_config={"effort": "minimal"})
    with pytest.raises(APIError, match=r"output_config\.effort: 'minimal' is not one of low, medium, high"):
        anthropic_routes.conversation_of(body)
