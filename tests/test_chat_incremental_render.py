"""Incremental rendering (chat/incremental_render.py) gives exactly the text of the full render, on every chat
template we ship, over randomized agent conversations (tool calls, parallel results, reasoning, text parts,
unicode, edits of an earlier message), and it does render incrementally where the template allows."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from agentbox.chat.incremental_render import IncrementalRenderer, probe_conversations
from agentbox.chat.render import render_prompt
from tests.test_chat_incremental import TOOLS, conversation, tokenizers, turns  # noqa: F401 - the fixture


@pytest.mark.parametrize("template", ["smollm2", "qwen3", "harmony", "deepseek_v4", "qwen3_8"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=conversation())
def test_incremental_text_equals_full_render(tokenizers: dict, template: str,  # noqa: F811
                                             case: tuple[list[dict], bool, int | None]) -> None:
    tok = tokenizers[template]
    msgs, with_tools, edit = case
    r = IncrementalRenderer(tok, 4)
    tools = TOOLS if with_tools else None
    for turn, sent in turns(msgs, edit):
        assert r.render(sent, tools) == render_prompt(tok, sent, tools), (template, turn)


# Which of an agent's conversations each template renders incrementally: plain calls; reasoning (gpt-oss drops
# it before a final answer; our Qwen3 test template renders it for the last message only); text beside calls
# (gpt-oss renders it as analysis, dropped the same way).
INCREMENTAL = {"smollm2": (True, True, True), "qwen3": (True, True, True), "harmony": (True, False, False)}


@pytest.mark.parametrize("template", ["smollm2", "qwen3", "harmony"])
def test_agent_turns_render_incrementally(tokenizers: dict, template: str) -> None:  # noqa: F811
    """Every template we ship renders a plain agent's turns incrementally; where a template treats reasoning
    or text beside calls non-locally, those conversations render in full. The text is right either way."""
    tok = tokenizers[template]
    for expect, features in zip(INCREMENTAL[template], [(False, False), (True, False), (False, True)], strict=True):
        msgs = probe_conversations(*features)[0]
        r = IncrementalRenderer(tok, 4)
        ends = [i for i, m in enumerate(msgs) if m["role"] == "assistant"] + [len(msgs)]
        for end in ends:
            assert r.render(msgs[:end], TOOLS) == render_prompt(tok, msgs[:end], TOOLS)
        assert (r.incremental_renders > 0) == expect, (template, features)
        if expect and template != "harmony":  # gpt-oss names a tool result after the call before it: not alone
            assert r.incremental_renders == len(ends) - 1, (template, features)


def test_other_options_or_an_edit_render_in_full(tokenizers: dict) -> None:  # noqa: F811
    tok = tokenizers["smollm2"]
    msgs = probe_conversations(False)[0]
    r = IncrementalRenderer(tok, 4)
    r.render(msgs[:3], TOOLS)
    assert r.render(msgs[:5], None) == render_prompt(tok, msgs[:5], None)  # other tools: nothing kept matches
    edited = [msgs[0], {**msgs[1], "content": "Another task."}, *msgs[2:5]]
    assert r.render(edited, TOOLS) == render_prompt(tok, edited, TOOLS)
    assert r.incremental_renders == 0 and r.full_renders == 3
    assert r.render(msgs[:7], TOOLS) == render_prompt(tok, msgs[:7], TOOLS)  # continues the first one
    assert r.incremental_renders == 1
