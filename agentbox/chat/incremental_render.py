"""Incremental rendering of a growing conversation: a warm turn renders only the messages it appended.

Rendering a 128k-token agent conversation walks every message through the chat template (and the tool
folding, the per-message normalisation): 40-70 ms a turn on this 2-core EPYC, growing with the history. An
agent's turn N+1 is turn N's messages plus a few new ones, and render.py renders prefix-stably, so turn N+1's
text is turn N's text (less its generation prompt) plus the new messages' part. That part is rendered on a
short stand-in of the conversation, the anchor: the leading system message (where the tools go) and the last
kept message, then the new messages. Its rendering less the anchor's own is the new part.

This is exact only for templates whose rendering of a message does not depend on messages far from it. What
is checked, so a mismatch falls back to the full render:
- once per template and options, a probe: a battery of agent conversations (tool calls, parallel results,
  text turns, with and without a system message) rendered turn by turn both ways must agree, once without
  and once with reasoning in the assistant messages (Qwen3's template drops the reasoning of every turn
  before the last user query: rendering such conversations incrementally is refused, not guessed);
- on every turn: the anchor renders as the kept text ends (the last kept message renders the same alone as
  in its conversation; a changed system part, say a date, shows here), the anchor's text is a prefix of the
  anchor-plus-new text (appending does not rewrite the boundary: Qwen3 closes a tool result only when no
  other result follows) and the kept text ends with the generation prompt the anchor gets;
- a system message past the first, or any difference in the kept messages (an edit), renders in full.
The property test (tests/test_chat_incremental_render.py) compares both ways on randomized conversations for
every template we ship.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from agentbox.chat.effort import ReasoningEffort
from agentbox.chat.render import render_prompt
from agentbox.chat.template import template_text
from agentbox.prefix import common_prefix

SYSTEM_ROLES = ("system", "developer")
PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_read", "description": "read a file",
                                                 "parameters": {"type": "object",
                                                                "properties": {"path": {"type": "string"}}}}}]


@dataclass
class Kept:
    """A conversation rendered before: its messages as sent (references), options and text."""

    key: tuple[Any, ...]
    tools: list[dict] | None
    messages: list[dict]
    text: str
    features: tuple[bool, bool]  # a message carries reasoning; an assistant writes text beside its calls
    late_system: bool  # a system message past the first


def _features(msgs: list[dict]) -> tuple[bool, bool]:
    """What templates treat non-locally: reasoning (Qwen3 drops it before the last user query, gpt-oss before a
    final answer) and text beside tool calls (gpt-oss renders it as analysis, dropped the same way)."""
    reasoning = any(m.get("reasoning_content") or m.get("reasoning") or m.get("thinking") for m in msgs)
    call_text = any(m.get("tool_calls") and m.get("content") for m in msgs)
    return reasoning, call_text


def _union(a: tuple[bool, bool], b: tuple[bool, bool]) -> tuple[bool, bool]:
    return a[0] or b[0], a[1] or b[1]


def _late_system(msgs: list[dict], first: int) -> bool:
    return any(m.get("role") in SYSTEM_ROLES for i, m in enumerate(msgs, first) if i > 0)


class IncrementalRenderer:
    """`render(...)` equal to `render_prompt(tokenizer, ...)`, rendering only what a kept conversation lacks.
    Not thread-safe (the server renders on one thread at a time per tokenizer)."""

    def __init__(self, tokenizer: Any, max_conversations: int, probe: bool = True) -> None:
        self.tok = tokenizer
        self.probe = probe  # False: skip the per-template probe (the probe's own twin)
        self.max_conversations = max_conversations
        self.kept: OrderedDict[int, Kept] = OrderedDict()  # least recent first
        self._probed: dict[tuple[Any, ...], bool] = {}
        self.incremental_renders = 0  # counters: turns rendered from a kept conversation, and in full
        self.full_renders = 0

    def copy(self) -> IncrementalRenderer:
        """A twin with the same kept conversations (benchmarks time one render from the same state repeatedly)."""
        twin = IncrementalRenderer(self.tok, self.max_conversations, self.probe)
        twin.kept, twin._probed = OrderedDict(self.kept), self._probed
        return twin

    def render(self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, reasoning_effort: ReasoningEffort | None = None,
               tool_parser: str = "hermes") -> str:
        opts = {"add_generation_prompt": add_generation_prompt, "enable_thinking": enable_thinking,
                "reasoning_effort": reasoning_effort, "tool_parser": tool_parser}
        key = (template_text(self.tok, tools=bool(tools)), add_generation_prompt, enable_thinking,
               reasoning_effort, tool_parser)
        base = self._base(key, tools, messages)
        text = None
        if base is not None:
            text = self._extend(base, messages, tools, opts)
        if text is None:
            self.full_renders += 1
            text = render_prompt(self.tok, messages, tools, **opts)
        else:
            self.incremental_renders += 1
        self._keep(key, tools, messages, text, base)
        return text

    def _base(self, key: tuple[Any, ...], tools: list[dict] | None, messages: list[dict]) -> Kept | None:
        """The most recent kept conversation with these options whose messages begin `messages` (and are fewer)."""
        for kept in reversed(self.kept.values()):
            k = len(kept.messages)
            if (kept.key == key and 0 < k < len(messages) and messages[k - 1] == kept.messages[-1]
                    and kept.tools == tools and messages[:k] == kept.messages):
                return kept
        return None

    def _keep(self, key: tuple[Any, ...], tools: list[dict] | None, messages: list[dict], text: str,
              base: Kept | None) -> None:
        if base is not None:
            self.kept.pop(id(base), None)  # this conversation continues that one: it takes its place
            k = len(base.messages)
            features = _union(base.features, _features(messages[k:]))
            late = base.late_system or _late_system(messages[k:], k)
        else:
            features, late = _features(messages), _late_system(messages, 0)
        entry = Kept(key, tools, list(messages), text, features, late)
        self.kept[id(entry)] = entry
        while len(self.kept) > self.max_conversations:
            self.kept.popitem(last=False)

    def _extend(self, base: Kept, messages: list[dict], tools: list[dict] | None,
                opts: dict[str, Any]) -> str | None:
        """base's text plus the new messages' part, or None when a check says the template is not local here."""
        k = len(base.messages)
        new = messages[k:]
        features = _union(base.features, _features(new))
        if base.late_system or _late_system(new, k) or not self._local(base.key, bool(tools), features, opts):
            return None
        try:
            return self._extend_unchecked(base.text, messages, k, tools, opts)
        except Exception:  # noqa: BLE001 - the full render raises it again, worded for the client
            return None

    def _extend_unchecked(self, kept_text: str, messages: list[dict], k: int, tools: list[dict] | None,
                          opts: dict[str, Any]) -> str | None:
        head = [messages[0]] if k > 1 and messages[0].get("role") in SYSTEM_ROLES else []
        anchor = [*head, messages[k - 1]]
        plain = {**opts, "add_generation_prompt": False}
        a_text = render_prompt(self.tok, anchor, tools, **plain)
        if opts["add_generation_prompt"]:
            a_gen = render_prompt(self.tok, anchor, tools, **opts)
            if not a_gen.startswith(a_text) or not kept_text.endswith(a_gen[len(a_text):]):
                return None
            kept_text = kept_text[: len(kept_text) - (len(a_gen) - len(a_text))]
        c = common_prefix(a_text, kept_text[: len(a_text)])
        if not kept_text.endswith(a_text[c:]):
            return None  # the last kept message (or the system part) renders differently alone
        d_text = render_prompt(self.tok, [*anchor, *messages[k:]], tools, **opts)
        if not d_text.startswith(a_text):
            return None  # appending rewrites the boundary
        return kept_text + d_text[len(a_text):]

    def _local(self, key: tuple[Any, ...], with_tools: bool, features: tuple[bool, bool],
               opts: dict[str, Any]) -> bool:
        """Whether the probe conversations render the same incrementally as in full (once per options)."""
        if not self.probe:
            return True
        probe_key = (*key, with_tools, features)
        if probe_key not in self._probed:
            self._probed[probe_key] = self._probe(with_tools, features, opts)
        return self._probed[probe_key]

    def _probe(self, with_tools: bool, features: tuple[bool, bool], opts: dict[str, Any]) -> bool:
        tools = PROBE_TOOLS if with_tools else None
        twin = IncrementalRenderer(self.tok, 1, probe=False)
        try:
            for msgs in probe_conversations(*features):
                twin.kept.clear()
                ends = [i for i, m in enumerate(msgs) if m["role"] == "assistant"] + [len(msgs)]
                for end in ends:
                    if twin.render(msgs[:end], tools, **opts) != render_prompt(self.tok, msgs[:end], tools, **opts):
                        return False
        except Exception:  # noqa: BLE001 - a template that rejects a probe conversation renders in full
            return False
        return twin.incremental_renders > 0


def probe_conversations(reasoning: bool, call_text: bool = False) -> list[list[dict]]:
    """Agent-shaped conversations: a task, tool calls (one, then two in parallel), results, a text answer, a
    new user turn, more calls; with a system message and without; with reasoning, text beside the calls."""
    def asst(k: int, calls: int, text: str = "") -> dict:
        m: dict[str, Any] = {"role": "assistant", "content": f"Let me look ({k})." if calls and call_text else text}
        if calls:
            m["tool_calls"] = [{"id": f"p{k}_{j}", "type": "function",
                                "function": {"name": "probe_read", "arguments": f'{{"path": "f{k}{j}.py"}}'}}
                               for j in range(calls)]
        if reasoning:
            m["reasoning_content"] = f"Thinking about step {k}."
            if calls and not call_text:
                m["content"] = ""  # gpt-oss's template takes a call's analysis as reasoning or text, not both
        return m

    def results(k: int, calls: int) -> list[dict]:
        return [{"role": "tool", "tool_call_id": f"p{k}_{j}", "content": f"line {k}{j}\n  x = {j}"}
                for j in range(calls)]

    def user(text: str) -> dict:
        return {"role": "user", "content": text}

    body = [user("Fix the failing test."),
            asst(0, 1), *results(0, 1), asst(1, 2), *results(1, 2), asst(2, 0, "Fixed it."),
            {"role": "user", "content": [{"type": "text", "text": "Now run the linter."}]},
            asst(3, 1), *results(3, 1), asst(4, 0, "Clean."), user("Thanks.")]
    # A user turn right after tool results, then a final answer: gpt-oss's template drops the analysis of
    # every call before a final answer, which only this order shows at a turn's boundary.
    interrupted = [user("Look at f.py."), asst(5, 1), *results(5, 1), user("Also g.py."), asst(6, 0, "Both fine."),
                   user("Good."), asst(7, 2), *results(7, 2), user("And h.py?"), asst(8, 0, "Fine too."), user("Ok.")]
    system = {"role": "system", "content": "You are a coding agent."}
    return [[system, *body], body, [system, *interrupted], interrupted]


_by_tokenizer: weakref.WeakKeyDictionary[Any, IncrementalRenderer] = weakref.WeakKeyDictionary()


def renderer_for(tokenizer: Any, max_conversations: int) -> IncrementalRenderer:
    """The server's one incremental renderer per tokenizer (made on first use)."""
    r = _by_tokenizer.get(tokenizer)
    if r is None:
        r = _by_tokenizer[tokenizer] = IncrementalRenderer(tokenizer, max_conversations)
    return r
