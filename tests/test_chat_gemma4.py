"""Gemma 4's formats on our own test template reproducing Gemma 4's published chat format (tests/data/, not
the released file): the template's rendering of a tool call reads back as the same call (strings with commas,
braces and quotes, nested objects, lists, booleans, numbers), fed whole or one character at a time; its thought
channel splits from the answer; the template is recognised."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2

from agentbox.chat.reasoning import ReasoningSplitter
from agentbox.chat.tool_parsers import collect, detect_tool_parser, get_tool_parser
from agentbox.server.chat_pipeline import reasoning_style_of

TEMPLATE = (Path(__file__).parent / "data" / "gemma4_format_chat_template.jinja").read_text()
ARGS = {"path": "src/a.py", "old": 'x = {"a": 1}, y', "n": 3, "ratio": 0.5, "force": False,
        "tags": ["a", "b, c"], "opts": {"depth": 2, "mode": "fast"}}


def _render(messages: list[dict]) -> str:
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    return env.from_string(TEMPLATE).render(messages=messages, bos_token="<bos>", add_generation_prompt=False)


def test_template_rendered_call_reads_back_whole_and_streamed() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "edit_file", "arguments": ARGS}}
    text = _render([{"role": "user", "content": "Edit."}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    turn = text.split("<|turn>model\n")[1].split("<turn|>")[0]
    assert turn.startswith("<|tool_call>call:edit_file{")
    output = "I will edit it.\n" + turn
    whole = get_tool_parser("gemma4").parse(output)
    assert whole.content.rstrip() == "I will edit it."
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("edit_file", ARGS)]
    stream = get_tool_parser("gemma4").stream()
    streamed = collect([d for ch in output for d in stream.feed(ch)] + stream.finish())
    assert (streamed.content, [(c.name, c.arguments) for c in streamed.tool_calls]) == (
        whole.content, [(c.name, c.arguments) for c in whole.tool_calls])


def test_two_calls_and_an_unfinished_one() -> None:
    p = get_tool_parser("gemma4")
    two = p.parse('<|tool_call>call:a{x:1}<tool_call|><|tool_call>call:b{y:<|"|>z<|"|>}<tool_call|>')
    assert [(c.name, json.loads(c.arguments)) for c in two.tool_calls] == [("a", {"x": 1}), ("b", {"y": "z"})]
    cut = p.parse('Text <|tool_call>call:a{x:<|"|>never closed')
    assert cut.content.startswith("Text") and not any(c.arguments for c in cut.tool_calls)


def test_thought_channel_and_template_detection() -> None:
    assert (detect_tool_parser(TEMPLATE), reasoning_style_of(TEMPLATE)) == ("gemma4", "gemma4")
    out = "<|channel>thought\nThe user wants 4.<channel|>Four."
    assert ReasoningSplitter("gemma4").split(out) == ("The user wants 4.", "Four.")
    s = ReasoningSplitter("gemma4")
    deltas = [d for ch in out for d in s.feed(ch)] + s.finish()
    assert ("".join(d.reasoning or "" for d in deltas), "".join(d.content or "" for d in deltas)) == (
        "The user wants 4.", "Four.")
    # Thinking off (the default): the prompt itself closes an empty thought channel
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    gen = env.from_string(TEMPLATE).render(messages=[{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
    assert gen.endswith("<|turn>model\n<|channel>thought\n<channel|>")
