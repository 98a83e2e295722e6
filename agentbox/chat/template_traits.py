"""What a chat template refuses that agents send, found by rendering two probe conversations once per template,
and the rewrite that makes such a conversation render (render.py applies it).

Qwen3.5 / 3.6 / 3.8 templates raise "System message must be at the beginning." for a system message past the
first (Claude Code's and opencode's reminders mid-session) and "No user query found in messages." for a
conversation without a user query (one that opens with an assistant turn or tool results: a resumed sub-agent, a
compacted history). Each rewrite is a pure function of the messages that keeps every message where it was, so
turn N+1's prompt still starts with turn N's: merging a late system message into the first one instead would
change the first tokens of the prompt, and with them every cached page and recurrent-state snapshot of the session.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

TOOL_RESPONSE = ("<tool_response>", "</tool_response>")
SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class TemplateTraits:
    rejects_late_system: bool  # a system message past the first is a template error
    needs_user_query: bool  # a conversation without a user query is a template error


_traits: dict[str, TemplateTraits] = {}


def _raises(apply: Callable[[list[dict]], str], messages: list[dict]) -> bool:
    try:
        apply(messages)
    except TemplateError:
        return True
    return False


def traits_of(template: str, apply: Callable[[list[dict]], str]) -> TemplateTraits:
    """The template's traits, probed once per template text with `apply` (a render under the request's options)."""
    if template not in _traits:
        # Each probe differs from a conversation the template accepts in the one trait it tests.
        late = _raises(apply, [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                               {"role": "user", "content": "c"}])
        no_query = _raises(apply, [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]) is False \
            and _raises(apply, [{"role": "assistant", "content": "a"}])
        _traits[template] = TemplateTraits(late, no_query)
    return _traits[template]


def is_user_query(message: dict) -> bool:
    """A user message that is not tool results written as text (what the Qwen templates count as a query)."""
    if message.get("role") != "user":
        return False
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    text = text.strip()
    return not (text.startswith(TOOL_RESPONSE[0]) and text.endswith(TOOL_RESPONSE[1]))


def late_system_as_user(messages: list[dict]) -> list[dict]:
    """Every system message past the leading ones as a user turn in its place (the role these templates accept
    there); the leading ones stay system messages."""
    first = next((i for i, m in enumerate(messages) if m.get("role") not in SYSTEM_ROLES), len(messages))
    return [*messages[:first], *({**m, "role": "user"} if m.get("role") in SYSTEM_ROLES else m
                                 for m in messages[first:])]


def open_with_user_query(messages: list[dict]) -> list[dict]:
    """An empty user turn before the first message after the leading system ones, when that message is not a user
    query. Decided by the conversation's first message alone, so every later turn of it gets the same turn."""
    first = next((i for i, m in enumerate(messages) if m.get("role") not in SYSTEM_ROLES), None)
    if first is None or is_user_query(messages[first]):
        return messages
    return [*messages[:first], {"role": "user", "content": ""}, *messages[first:]]
