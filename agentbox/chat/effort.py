"""How hard a reasoning model should think, as the APIs name it: OpenAI chat's `reasoning_effort` and
Responses' `reasoning.effort` (none, minimal, low, medium, high, xhigh), Anthropic's `output_config.effort`
(low, medium, high, xhigh, max). The chat template decides what a level means for its model (gpt-oss:
`Reasoning: low|medium|high` in its system message, chat/harmony.py); no effort sent leaves the template's
default, so the prompt of a client that never sends one does not change.

Anthropic's `thinking.budget_tokens` is a token cap, not a level, and the conventions that turn one into the
other disagree (1024/2048/4096 in one proxy, a share of max_tokens in another), so it carries no effort here.
"""

from __future__ import annotations

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
