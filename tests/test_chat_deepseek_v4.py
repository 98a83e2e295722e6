"""DeepSeek-V4's chat format: DSML tool calls (`<｜DSML｜tool_calls>` blocks of `invoke`s whose parameters say
whether they are strings or JSON), `<think>` reasoning opened by the prompt when thinking is on, and byte stability:
every turn's prompt starts with the previous turn's prompt plus what the model wrote (reasoning, answer, tool call)
as the server renders it back from the parsed message, with tools and without. The template keeps earlier turns'
reasoning only with `drop_thinking` off (which the renderer passes); the last test shows a new user turn breaking
the prefix without it, so the stability test can fail.

The template is tests/fixtures/deepseek_v4_chat_template.jinja, a byte copy of llama.cpp's
models/templates/deepseek-ai-DeepSeek-V4.jinja as vendored by llama-cpp-python 0.3.36 (what its converter writes
into a DeepSeek-V4 GGUF: the release ships no Jinja template)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from chat_turns import as_message, turn_pairs

from agentbox.chat.render import prepare_messages, render_prompt
from agentbox.chat.tool_parsers import collect, detect_tool_parser, get_tool_parser
from agentbox.server.chat_pipeline import reasoning_style_of

TEMPLATE = (Path(__file__).parent / "fixtures" / "deepseek_v4_chat_template.jinja").read_text()
EOS = "<｜end▁of▁sentence｜>"
D = "｜DSML｜"
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
                   "required": ["path"]}}}]
CALL_A = (f'\n\n<{D}tool_calls>\n<{D}invoke name="read_file">\n<{D}parameter name="path" string="true">src/a.py'
          f'</{D}parameter>\n<{D}parameter name="lines" string="false">40</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')
CALL_B = (f'\n\n<{D}tool_calls>\n<{D}invoke name="read_file">\n<{D}parameter name="path" string="true">src/b.py'
          f'</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')
# What the model writes each turn after the prompt's `<think>`: reasoning, an answer, maybe a tool call.
OUTPUTS = [
    "The test fails in a.py; read it first.</think>Reading the file." + CALL_A + EOS,
    "Line 12 divides by zero.</think>The bug is on line 12: a division by zero." + EOS,
    "The user wants a fix; b.py has the caller.</think>" + CALL_B + EOS,  # the template always writes the blank line
]
FOLLOW_UPS: list[list[dict[str, Any]]] = [
    [{"role": "tool", "tool_call_id": "c0", "content": "def f(x):\n    return 1 / x"}],
    [{"role": "user", "content": "Fix it, please."}],
    [],
]


# The release tokenizer's added tokens the template writes (each one token there, never merged with its neighbours)
SPECIAL = ["<｜begin▁of▁sentence｜>", EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):  # noqa: ANN001, ANN201 - SmolLM2's tokens, DeepSeek-V4's template and added tokens
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    return tok


def test_the_template_names_its_formats() -> None:
    assert detect_tool_parser(TEMPLATE) == "deepseek_v4"
    assert reasoning_style_of(TEMPLATE) == "qwen3"  # <think> ... </think>


def test_dsml_calls_parse_alike_whole_and_streamed() -> None:
    text = "Two reads." + CALL_A.replace(f"</{D}invoke>\n</{D}tool_calls>", f'</{D}invoke>\n<{D}invoke name="ls">\n'
                                         f"</{D}invoke>\n</{D}tool_calls>")
    parser = get_tool_parser("deepseek_v4", TOOLS)
    whole = parser.parse(text)
    assert whole.content == "Two reads."
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [
        ("read_file", '{"path": "src/a.py", "lines": 40}'), ("ls", "{}")]
    stream = parser.stream()
    pieces = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    streamed = collect(pieces)
    assert streamed.content == whole.content
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    # V3.2's block name, and a JSON value that is no JSON kept as the schema says
    v32 = f'<{D}function_calls>\n<{D}invoke name="read_file">\n<{D}parameter name="lines" string="false">x</{D}parameter>\n'
    assert parser.parse(v32 + f"</{D}invoke>\n</{D}function_calls>").tool_calls[0].arguments == '{"lines": "x"}'


def _as_message(prompt: str, output: str) -> dict[str, Any]:
    return as_message(prompt, output, "deepseek_v4", TOOLS, EOS)


def _conversation(render: Any) -> list[tuple[str, str]]:
    """(prompt + output of turn N, prompt of turn N+1) for each turn."""
    return turn_pairs(render, OUTPUTS, FOLLOW_UPS, _as_message)


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_turn_n_plus_1_starts_with_turn_n_tokens(tokenizer, tools: list[dict] | None) -> None:  # noqa: ANN001
    parsed = _as_message("<think>", OUTPUTS[0])
    assert parsed["reasoning_content"] == "The test fails in a.py; read it first."
    assert parsed["tool_calls"][0]["function"]["arguments"] == '{"path": "src/a.py", "lines": 40}'

    pairs = _conversation(lambda m: render_prompt(tokenizer, m, tools, enable_thinking=True, tool_parser="deepseek_v4"))
    assert pairs[0][0].endswith(CALL_A + EOS) and "<｜Assistant｜><think>The test fails" in pairs[0][0]
    for ended, nxt in pairs:
        assert nxt.startswith(ended), (ended[-200:], nxt[len(ended) - 200 : len(ended) + 50])
        ids = tokenizer.encode(ended, add_special_tokens=False)
        assert tokenizer.encode(nxt, add_special_tokens=False)[: len(ids)] == ids


def test_without_drop_thinking_off_a_new_user_turn_breaks_the_prefix(tokenizer) -> None:  # noqa: ANN001
    """A chat without tools: the template's default drops the answered turn's reasoning once a user speaks."""
    def render(messages: list[dict[str, Any]], **kw: Any) -> str:
        return tokenizer.apply_chat_template(prepare_messages(messages, TEMPLATE), tokenize=False,
                                             add_generation_prompt=True, enable_thinking=True, **kw)

    messages: list[dict[str, Any]] = [{"role": "user", "content": "Why does f fail?"}]
    ended = render(messages) + OUTPUTS[1]
    messages += [_as_message("<think>", OUTPUTS[1]), {"role": "user", "content": "Fix it, please."}]
    assert not render(messages).startswith(ended)
    assert render(messages, drop_thinking=False).startswith(ended)
