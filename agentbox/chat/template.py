"""The tokenizer's chat template as text: what rendering (render.py) fills in and what the dialect checks
(harmony.py) read. A leaf of chat/, so those two need not import each other."""

from __future__ import annotations

from typing import Any


def template_text(tokenizer: Any, tools: bool = False) -> str:
    t = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(t, dict):  # named templates: prefer the tool_use one when tools are present
        t = (t.get("tool_use") if tools else None) or t.get("default") or next(iter(t.values()), "")
    return t
