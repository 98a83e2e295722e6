"""Reasoning split: <think>…</think> goes to reasoning only, streamed split at every position."""

from __future__ import annotations

import pytest

from agentbox.chat.reasoning import ReasoningSplitter, prompt_opens_reasoning
from agentbox.chat.tool_parsers import collect, get_tool_parser

# (style, starts_inside, output, reasoning, content)
CASES = [
    ("qwen3", False, "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "\nThe user wants 2+2.\n", "It is 4."),
    ("qwen3", True, "Hmm, < and > are fine </thin here.</think>\n\nDone.", "Hmm, < and > are fine </thin here.", "Done."),
    ("qwen3", False, "No thinking here, <think> mid-text stays.", "", "No thinking here, <think> mid-text stays."),
    ("qwen3", False, "<think>cut off mid thought", "cut off mid thought", ""),
    ("deepseek_r1", False, "First, consider x.</think>The answer is x.", "First, consider x.", "The answer is x."),
    ("deepseek_r1", False, "<think>y</think>\nz", "y", "z"),
    ("none", False, "<think>kept</think>", "", "<think>kept</think>"),
    # GLM-4.7: an empty thinking block is its closer alone, whether or not the prompt opened it
    ("glm45", False, "</think><tool_call>ls</tool_call>", "", "<tool_call>ls</tool_call>"),
    ("glm45", True, "</think>Done.", "", "Done."),
    ("qwen3", False, "</think>\nDone.", "", "Done."),
]


@pytest.mark.parametrize("style,inside,text,reasoning,content", CASES)
def test_split_whole_and_streamed(style: str, inside: bool, text: str, reasoning: str, content: str) -> None:
    assert ReasoningSplitter(style, starts_inside=inside).split(text) == (reasoning, content)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            s = ReasoningSplitter(style, starts_inside=inside)
            deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
            got = ("".join(d.reasoning or "" for d in deltas), "".join(d.content or "" for d in deltas))
            assert got == (reasoning, content), f"split at {cut}"
            assert all((d.reasoning is None) != (d.content is None) for d in deltas)


def test_reasoning_never_reaches_tool_arguments() -> None:
    """The chain the server runs: reasoning split first, then the tool parser over content only."""
    text = (
        '<think>maybe <tool_call>\n{"name": "rm", "arguments": {"path": "/"}}\n</tool_call> no.</think>\n\n'
        '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'
    )
    for cut in range(len(text) + 1):
        rs, ts = ReasoningSplitter("qwen3"), get_tool_parser("hermes").stream()
        out, reasoning = [], ""
        for piece in (text[:cut], text[cut:]):
            for d in rs.feed(piece):
                reasoning += d.reasoning or ""
                out += ts.feed(d.content) if d.content else []
        for d in rs.finish():
            reasoning += d.reasoning or ""
            out += ts.feed(d.content) if d.content else []
        parsed = collect(out + ts.finish())
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("ls", '{"path": "."}')]
        assert parsed.content == "" and "rm" in reasoning


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", "none")
    with pytest.raises(ValueError):
        ReasoningSplitter("nonesuch")
