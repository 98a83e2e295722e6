"""Where a rendered prompt's history ends: before the generation prompt the chat template appends
(`<|im_start|>assistant\\n`, GLM's `<|assistant|><think>`).

The next turn re-sends the history, then renders the answer where this turn had the generation prompt, and
often not as the same tokens: GLM drops the opened `<think>`, Qwen3 without thinking closes an empty one. A
hybrid model resumes only where a state snapshot stands, so the prompt's snapshot must be taken at or before
the history's end to be of use to the next turn (engine/cache/state_group.py); taken at the prompt's end, it
lies past where the next turn diverges whenever the generation prompt crosses a page boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentbox.chat.effort import ReasoningEffort
from agentbox.chat.render import render_prompt
from agentbox.chat.template import template_text

_PROBE = [{"role": "user", "content": "Hello."}]
# (template, options) -> the text the template appends for the answer, or None (none, or not a plain suffix)
_suffixes: dict[tuple[Any, ...], str | None] = {}


def generation_suffix(tokenizer: Any, enable_thinking: bool | None, reasoning_effort: ReasoningEffort | None,
                      tool_parser: str) -> str | None:
    """The text the template appends for the answer under these options, found once on a one-message chat."""
    key = (template_text(tokenizer, tools=False), enable_thinking, reasoning_effort, tool_parser)
    if key not in _suffixes:
        opts = {"enable_thinking": enable_thinking, "reasoning_effort": reasoning_effort, "tool_parser": tool_parser}
        try:
            with_gen = render_prompt(tokenizer, _PROBE, add_generation_prompt=True, **opts)
            plain = render_prompt(tokenizer, _PROBE, add_generation_prompt=False, **opts)
        except Exception:  # noqa: BLE001 - a template that rejects the probe gets no hint, not an error
            with_gen = plain = ""
        _suffixes[key] = with_gen[len(plain):] if with_gen.startswith(plain) and len(with_gen) > len(plain) else None
    return _suffixes[key]


def history_end(tokenizer: Any, text: str, ids: Sequence[int], suffix: str | None) -> int:
    """The number of `ids` (the tokens of `text`) before the generation prompt `suffix`; 0 when text does not end
    with it or its tokens do not end the ids as they are on their own (then no position is claimed)."""
    if not suffix or not text.endswith(suffix):
        return 0
    tail = tokenizer.encode(suffix, add_special_tokens=False)
    n = len(tail)
    if n == 0 or n >= len(ids) or list(ids[len(ids) - n:]) != list(tail):
        return 0
    return len(ids) - n
