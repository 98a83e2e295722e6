"""Byte stability of an agent conversation under a Qwen3.6-style chat template: every turn's prompt starts with
the previous turn's prompt plus what the model wrote (reasoning, answer, qwen3_coder tool call), as the server
renders it back from the parsed message. Without it a hybrid model's state snapshot of turn N cannot serve
turn N+1. The template keeps earlier reasoning only under `preserve_thinking` (which the renderer passes); the
last check shows the same conversation breaking without it, so the test can fail.

The template is tests/fixtures/qwen3_6_like_chat_template.jinja, written after the released template's
documented behaviour (the released file itself is not redistributed here)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from chat_turns import as_message, turn_pairs

from agentbox.chat.render import prepare_messages, render_prompt
from agentbox.chat.tool_parsers import detect_tool_parser

TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3_6_like_chat_template.jinja").read_text()
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
                   "required": ["path"]}}}]
# What the model writes each turn after the prompt's `<think>\n`: reasoning, an answer, maybe a tool call.
OUTPUTS = [
    "The test fails in a.py; read it first.\n</think>\n\nReading the file.\n\n<tool_call>\n<function=read_file>\n"
    "<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=lines>\n40\n</parameter>\n</function>\n</tool_call><|im_end|>",
    "Line 12 divides by zero.\n</think>\n\nThe bug is on line 12: a division by zero.<|im_end|>",
    "The user wants a fix; b.py has the caller.\n</think>\n\n<tool_call>\n<function=read_file>\n<parameter=path>\n"
    "src/b.py\n</parameter>\n</function>\n</tool_call><|im_end|>",
]
FOLLOW_UPS: list[list[dict[str, Any]]] = [
    [{"role": "tool", "tool_call_id": "c0", "content": "def f(x):\n    return 1 / x"}],
    [{"role": "user", "content": "Fix it, please."}],
    [],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):  # noqa: ANN001, ANN201 - SmolLM2's tokens, the Qwen3.6-style template
    tok = copy.copy(smollm2_tokenizer)
    tok.chat_template = TEMPLATE
    return tok


def _as_message(prompt: str, output: str) -> dict[str, Any]:
    return as_message(prompt, output, "qwen3_coder", TOOLS, "<|im_end|>")


def _conversation(render: Any) -> list[tuple[str, str]]:
    """(prompt + output of turn N, prompt of turn N+1) for each turn."""
    return turn_pairs(render, OUTPUTS, FOLLOW_UPS, _as_message)


def test_turn_n_plus_1_starts_with_turn_n_tokens(tokenizer) -> None:  # noqa: ANN001
    assert detect_tool_parser(TEMPLATE) == "qwen3_coder"
    parsed = _as_message("<think>\n", OUTPUTS[0])
    assert parsed["tool_calls"][0]["function"]["name"] == "read_file"
    assert '"lines": 40' in parsed["tool_calls"][0]["function"]["arguments"]  # typed by the tool's schema

    pairs = _conversation(lambda m: render_prompt(tokenizer, m, TOOLS, tool_parser="qwen3_coder"))
    for ended, nxt in pairs:
        assert nxt.startswith(ended), (ended[-200:], nxt[len(ended) - 200 : len(ended) + 50])
        ids = tokenizer.encode(ended, add_special_tokens=False)
        assert tokenizer.encode(nxt, add_special_tokens=False)[: len(ids)] == ids


def test_without_preserve_thinking_a_new_user_turn_breaks_the_prefix(tokenizer) -> None:  # noqa: ANN001
    def render(messages: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(prepare_messages(messages, TEMPLATE), tools=TOOLS, tokenize=False,
                                             add_generation_prompt=True)

    pairs = _conversation(render)
    assert pairs[0][1].startswith(pairs[0][0])  # a tool result keeps the reasoning (no new user query)
    assert not pairs[1][1].startswith(pairs[1][0])  # after "Fix it" the earlier reasoning is dropped
