"""How hard a reasoning model should think, as the APIs name it: OpenAI chat's `reasoning_effort` and
Responses' `reasoning.effort` (none, minimal, low, medium, high, xhigh), Anthropic's `output_config.effort`
(low, medium, high, xhigh, max). The chat template decides what a level means for its model (gpt-oss:
`Reasoning: low|medium|high` in its system message, chat/harmony.py); no effort sent leaves the template's
default, so the prompt of a client that never sends one does not change, unless the model's profile names a
default of its own (Qwen3.8: medium, where its template's xhigh returns empty answers on about 17 % of calls).

A template that checks the level against a list of its own (Qwen3.8: xhigh, medium and low, anything else a
template error) gets the nearest level it names (`fit_to_template`): a client's `high` reaches Qwen3.8 as xhigh.

Anthropic's `thinking.budget_tokens` is a token cap, not a level, and the conventions that turn one into the
other disagree (1024/2048/4096 in one proxy, a share of max_tokens in another), so it carries no effort here.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Literal


class ReasoningEffort(Enum):
    NONE = "none"
    MINIMAL = "minimal"
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    XHIGH = "xhigh"
    MAX = "max"

    @property
    def switches_thinking_off(self) -> bool:
        """Templates with an on/off switch (Qwen3's enable_thinking) read none / minimal as off."""
        return self in (ReasoningEffort.NONE, ReasoningEffort.MINIMAL)


OpenAIEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]  # chat and Responses
ANTHROPIC_EFFORTS = ("low", "medium", "high", "xhigh", "max")  # output_config.effort


# Weakest to strongest: the order `fit_to_template` measures nearness in.
EFFORT_ORDER = tuple(ReasoningEffort)


def template_levels(template: str) -> frozenset[ReasoningEffort]:
    """The levels a template that reads `reasoning_effort` names as quoted strings (Qwen3.8's 'xhigh', 'medium',
    'low'); empty when it names fewer than two (DeepSeek-V4 tests for 'max' alone and takes any other value)."""
    if "reasoning_effort" not in template:
        return frozenset()
    named = frozenset(e for e in ReasoningEffort if re.search(rf"""['"]{e.value}['"]""", template))
    return named if len(named) >= 2 else frozenset()


def fit_to_template(effort: ReasoningEffort, template: str) -> ReasoningEffort:
    """`effort`, or the nearest level the template names where it names a list; a tie goes to the stronger one
    (`high` between medium and xhigh is xhigh: the template's own alias, and what peers send)."""
    levels = template_levels(template)
    if not levels or effort in levels:
        return effort
    at = EFFORT_ORDER.index(effort)
    return min(levels, key=lambda e: (abs(EFFORT_ORDER.index(e) - at), -EFFORT_ORDER.index(e)))
