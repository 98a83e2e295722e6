"""Shared by the byte-stability tests of chat templates: the assistant message the server returns for a model's
output (reasoning split, tool calls parsed), and the prompt pairs of a conversation turn by turn."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentbox.chat.reasoning import ReasoningSplitter, prompt_opens_reasoning
from agentbox.chat.tool_parsers import get_tool_parser


def as_message(prompt: str, output: str, parser: str, tools: list[dict], end: str) -> dict[str, Any]:
    """The assistant message the server returns for `output` (which ends with the turn's `end` token), as an
    agent sends it back."""
    splitter = ReasoningSplitter("qwen3", starts_inside=prompt_opens_reasoning(prompt))
    deltas = splitter.feed(output.removesuffix(end)) + splitter.finish()
    reasoning = "".join(d.reasoning or "" for d in deltas)
    parsed = get_tool_parser(parser, tools).parse("".join(d.content or "" for d in deltas))
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for i, c in enumerate(parsed.tool_calls)]
    return {"role": "assistant", "content": parsed.content, "reasoning_content": reasoning,
            **({"tool_calls": calls} if calls else {})}


def turn_pairs(render: Callable[[list[dict]], str], outputs: list[str], follow_ups: list[list[dict]],
               message: Callable[[str, str], dict[str, Any]]) -> list[tuple[str, str]]:
    """(prompt + output of turn N, prompt of turn N+1) for each turn of a coding agent's conversation."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "The tests fail. Find out why."}]
    pairs = []
    prompt = render(messages)
    for output, follow in zip(outputs, follow_ups, strict=True):
        messages += [message(prompt, output), *follow]
        nxt = render(messages)
        pairs.append((prompt + output, nxt))
        prompt = nxt
    return pairs
