"""Where a rendered chat prompt's history ends (chat/generation_prompt.py): the tokens the next turn repeats, on
the templates we ship tests for. What the engine does with it: test_hybrid_snapshots.py; end to end over HTTP:
test_glm5_next_sessions_http.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from glm_template import SPECIAL, TEMPLATE

from agentbox.chat.generation_prompt import history_end, unrepeated_tail
from agentbox.chat.render import render_prompt
from agentbox.prefix import common_prefix

HERE = Path(__file__).parent
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object",
                                                          "properties": {"path": {"type": "string"}}}}}]
START = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "The tests fail."}]
ANSWERS = [
    [{"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
     {"role": "tool", "tool_call_id": "c0", "content": "def f(): return 1 / 0"}],
    [{"role": "assistant", "content": "Line 1 divides by zero.", "reasoning_content": "Found it."},
     {"role": "user", "content": "Fix it."}],
]


def _glm(tok):  # noqa: ANN001, ANN202
    tok = copy.deepcopy(tok)
    tok.add_special_tokens({"additional_special_tokens": [*SPECIAL, "[gMASK]", "<sop>", "<think>", "</think>"]})
    tok.chat_template = TEMPLATE
    return tok


def _with(tok, template: Path):  # noqa: ANN001, ANN202
    tok = copy.deepcopy(tok)
    tok.chat_template = template.read_text()
    return tok


def _ids(tok, msgs: list[dict], thinking: bool | None) -> list[int]:  # noqa: ANN001
    return list(tok.encode(render_prompt(tok, msgs, TOOLS, enable_thinking=thinking), add_special_tokens=False))


CASES = {  # template: (tokenizer maker, enable_thinking, the tail the next turn does not repeat)
    "chatml": (lambda t: t, None, 0),
    "glm": (_glm, None, 1),  # <|assistant|><think>: the next turn has <|assistant|> then the answer
    "qwen3.6 thinking": (lambda t: _with(t, HERE / "fixtures" / "qwen3_6_like_chat_template.jinja"), None, 0),
    "qwen3.6 no thinking": (lambda t: _with(t, HERE / "fixtures" / "qwen3_6_like_chat_template.jinja"), False, 5),
    "gemma4": (lambda t: _with(t, HERE / "data" / "gemma4_format_chat_template.jinja"), None, 10),
}


@pytest.mark.parametrize("case", CASES)
def test_the_history_ends_where_the_next_turn_departs(smollm2_tokenizer, case: str) -> None:  # noqa: ANN001
    make, thinking, expected = CASES[case]
    tok = make(smollm2_tokenizer)
    tail = unrepeated_tail(tok, thinking, None, "hermes")
    assert tail is not None and tail[0] == expected
    for answer in ANSWERS:  # an agent's turns: a tool call and its result; reasoning, a text answer, a new task
        ids, nxt = _ids(tok, START, thinking), _ids(tok, START + answer, thinking)
        end = history_end(ids, tail)
        assert end == (len(ids) - expected if expected else 0)
        assert (end or len(ids)) <= common_prefix(ids, nxt)  # never past where the next turn departs


def test_no_claim_where_the_prompt_does_not_end_in_the_generation_prompt(smollm2_tokenizer) -> None:  # noqa: ANN001
    tok = _glm(smollm2_tokenizer)
    tail = unrepeated_tail(tok, None, None, "hermes")
    text = render_prompt(tok, START, add_generation_prompt=False)  # a completion-style prompt
    assert tail is not None and history_end(tok.encode(text, add_special_tokens=False), tail) == 0
    assert history_end(tail[1], tail) == 0  # nothing before the generation prompt
