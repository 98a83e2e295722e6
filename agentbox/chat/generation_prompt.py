"""Where a rendered prompt's history ends: the tokens the conversation's next turn will repeat.

A chat prompt ends in the template's generation prompt (`<|im_start|>assistant\\n`, GLM's `<|assistant|><think>`).
The next turn re-sends the history and renders the answer where that tail stood, not always as the same tokens:
GLM drops the opened `<think>`, a template that closes an empty thought writes `<think>\\n\\n` where the prompt
had `<think>\\n`. A hybrid model resumes only where a state snapshot stands, so the prompt's snapshot is of use
to the next turn only at or before that point (engine/cache/state_group.py); at the prompt's last page boundary
it lies past it whenever the tail crosses a boundary, and the next turn resumes a whole turn earlier.

How many tokens the next turn does not repeat is found once per template and options, on probe conversations:
one user message, then its continuation by a text answer, by an answer with reasoning and by a tool call. Their
renders' common token prefix with the first one's ends where the next turn departs from it; the largest tail
over the probes is taken (a few tokens too early costs those tokens, too late costs the turn).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentbox.chat.effort import ReasoningEffort
from agentbox.chat.incremental_render import PROBE_TOOLS
from agentbox.chat.render import render_prompt
from agentbox.chat.template import template_text
from agentbox.prefix import common_prefix

_USER = {"role": "user", "content": "List the files."}
_CALL = {"id": "c1", "type": "function", "function": {"name": "probe_read", "arguments": '{"path": "."}'}}
_NEXT_TURNS: list[tuple[list[dict], list[dict] | None]] = [
    ([_USER, {"role": "assistant", "content": "main.py"}, {"role": "user", "content": "Read it."}], None),
    ([_USER, {"role": "assistant", "content": "main.py", "reasoning_content": "One file."},
      {"role": "user", "content": "Read it."}], None),
    ([_USER, {"role": "assistant", "content": "", "tool_calls": [_CALL]},
      {"role": "tool", "tool_call_id": "c1", "content": "main.py"}], PROBE_TOOLS),
]
# (templates, options) -> (how many of a prompt's last tokens the next turn does not repeat, the generation prompt)
_tails: dict[tuple[Any, ...], tuple[int, list[int]] | None] = {}


def unrepeated_tail(tokenizer: Any, enable_thinking: bool | None, reasoning_effort: ReasoningEffort | None,
                    tool_parser: str) -> tuple[int, list[int]] | None:
    """How many of a prompt's last tokens the next turn does not repeat under these options, and the generation
    prompt's tokens (a prompt that ends in them is one the probes describe); None when the probes cannot tell."""
    key = (template_text(tokenizer, tools=False), template_text(tokenizer, tools=True), enable_thinking,
           reasoning_effort, tool_parser)
    if key not in _tails:
        _tails[key] = _probe(tokenizer, {"enable_thinking": enable_thinking, "reasoning_effort": reasoning_effort,
                                         "tool_parser": tool_parser})
    return _tails[key]


def _probe(tokenizer: Any, opts: dict[str, Any]) -> tuple[int, list[int]] | None:
    def ids(msgs: list[dict], tools: list[dict] | None, gen: bool = True) -> list[int]:
        text = render_prompt(tokenizer, msgs, tools, add_generation_prompt=gen, **opts)
        return list(tokenizer.encode(text, add_special_tokens=False))

    try:
        first = ids([_USER], None)
        gen = first[common_prefix(first, ids([_USER], None, gen=False)):]  # the generation prompt's tokens
    except Exception:  # noqa: BLE001 - a template that rejects even this tells nothing
        return None
    tails = []
    for msgs, tools in _NEXT_TURNS:
        try:
            start = first if tools is None else ids(msgs[:1], tools)
            tails.append(len(start) - common_prefix(start, ids(msgs, tools)))
        except Exception:  # noqa: BLE001 - a probe the template rejects (no reasoning, no tools) tells nothing
            continue
    return (max(tails), gen) if tails and gen else None


def history_end(ids: Sequence[int], tail: tuple[int, list[int]] | None) -> int:
    """The number of `ids` the next turn will repeat (see the module notes), when they end in the generation
    prompt the probes had; 0 when unknown, or when it is all of them (the prompt's own end serves)."""
    if tail is None or tail[0] == 0:
        return 0
    n, gen = tail
    if n >= len(ids) or len(gen) >= len(ids) or list(ids[len(ids) - len(gen):]) != gen:
        return 0
    return len(ids) - n
