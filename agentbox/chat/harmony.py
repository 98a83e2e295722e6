"""The harmony format of gpt-oss: messages in channels, reasoning and tool calls told apart by the header.

The model writes a sequence of messages, each `<|start|>ROLE [to=RECIPIENT]<|channel|>CHANNEL
[to=RECIPIENT] [<|constrain|>json]<|message|>BODY` closed by `<|end|>`, `<|call|>` (a tool call: the turn
stops) or `<|return|>` (the answer is done). The prompt ends with `<|start|>assistant`, so the output starts
at the first header. Channels: `analysis` is reasoning; `final` is the answer; `commentary` holds calls to
`functions.NAME` (and preambles meant for the user, which count as content).

`HarmonySplitter` is the reasoning splitter for this format (same feed / finish / split as
`ReasoningSplitter`): analysis bodies become reasoning, final and preamble bodies content, and each
function call is handed on as content in one normalised form, `to=functions.NAME<|message|>ARGS<|call|>`,
which the "openai" tool parser (tool_parsers/harmony.py) reads. So the tool parser, as for every other family,
sees only content, and no reasoning can reach tool arguments. Calls to built-in tools we do not serve
(`browser.*`, `python`) stay reasoning.

Special tokens must survive detokenization for this to work (`keeps_special_tokens`).

Rendering goes through the model's own chat template; `prepare_messages` only reshapes what it reads:
reasoning as `thinking`, and one tool call per assistant message (the template renders only the first),
each followed by its own result.
"""

from __future__ import annotations

import re
from typing import Any

from agentbox.chat.effort import ReasoningEffort
from agentbox.chat.template import template_text
from agentbox.chat.tool_parsers.base import Delta
from agentbox.chat.tool_parsers.harmony import CALL, CALL_OPENER, MESSAGE, partial_suffix

START, CHANNEL = "<|start|>", "<|channel|>"
END, RETURN = "<|end|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN)
MAX_HEADER = 256  # a header longer than this is not one: the model wrote plain text

_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT_RE = re.compile(r"to=([^\s<]+)")


def is_harmony_template(template: str) -> bool:
    return CHANNEL in template and MESSAGE in template


def keeps_special_tokens(tokenizer: Any) -> bool:
    """Harmony's markup is special tokens: detokenize with them, or the channels are lost."""
    return is_harmony_template(template_text(tokenizer))


# Gemma 4's special tokens its output parsers read (llama.cpp's converter marks the same ones to be rendered)
GEMMA4_VISIBLE = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
                  '<|"|>')


def hidden_special_ids(tokenizer: Any) -> frozenset[int] | None:
    """Gemma 4: the special token ids to drop when detokenizing (all but GEMMA4_VISIBLE, so its thought channel
    and tool calls reach the parsers and its end-of-turn token does not reach the client); None for others."""
    if "<|tool_call>call:" not in template_text(tokenizer):
        return None
    visible = {tokenizer.convert_tokens_to_ids(t) for t in GEMMA4_VISIBLE}
    return frozenset(i for i in tokenizer.all_special_ids if i not in visible)


class HarmonySplitter:
    """Feed output text (special tokens kept); get reasoning and content deltas (calls as normalised content)."""

    def __init__(self) -> None:
        self.buf = ""
        self.state = "header"  # header | body | between
        self.route = "content"  # where the open body goes: reasoning | content | call

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> list[Delta]:
        out = self._drain(final=True)
        if self.state == "body":
            out += self._emit(self.buf)
            if self.route == "call":
                out.append(Delta(content=CALL))  # cut off mid-call: close it so the parser sees the call
        elif self.state == "header" and self.buf.strip() and START not in self.buf and CHANNEL not in self.buf:
            out.append(Delta(content=self.buf))  # plain text with no harmony markup at all
        self.buf = ""
        return out

    def split(self, text: str) -> tuple[str, str]:
        """Non-streaming: (reasoning, content), calls left in content in normalised form."""
        deltas = self.feed(text) + self.finish()
        return "".join(d.reasoning or "" for d in deltas), "".join(d.content or "" for d in deltas)

    def _emit(self, text: str) -> list[Delta]:
        if not text:
            return []
        return [Delta(reasoning=text)] if self.route == "reasoning" else [Delta(content=text)]

    def _open(self, header: str) -> list[Delta]:
        channel_m, recipient_m = _CHANNEL_RE.search(header), _RECIPIENT_RE.search(header)
        channel = channel_m.group(1) if channel_m else "final"
        recipient = recipient_m.group(1) if recipient_m else None
        if recipient is not None and recipient not in ("assistant", "user"):
            if recipient.startswith("functions."):
                self.route = "call"
                return [Delta(content=f"{CALL_OPENER}{recipient[len('functions.'):]}{MESSAGE}")]
            self.route = "reasoning"  # a built-in tool (browser, python): the model's own business
        else:
            self.route = "reasoning" if channel == "analysis" else "content"
        return []

    def _drain(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while self.buf:
            if self.state == "between":
                i = self.buf.find(START)
                j = self.buf.find(CHANNEL)
                if i < 0 and j < 0:
                    keep = partial_suffix(self.buf, (START, CHANNEL))
                    self.buf = self.buf[len(self.buf) - keep :] if keep else ""  # stray text between messages
                    return out
                cut = i + len(START) if i >= 0 and (j < 0 or i < j) else j
                self.buf = self.buf[cut:]
                self.state = "header"
                continue
            if self.state == "header":
                i = self.buf.find(MESSAGE)
                if i < 0:
                    if len(self.buf) > MAX_HEADER and START not in self.buf and CHANNEL not in self.buf:
                        self.state, self.route = "body", "content"  # no header: plain text is the answer
                        continue
                    return out
                out += self._open(self.buf[:i])
                self.buf = self.buf[i + len(MESSAGE) :]
                self.state = "body"
                continue
            # body
            hits = [(self.buf.find(t), t) for t in BODY_ENDS if t in self.buf]
            if hits:
                i, tag = min(hits)
                out += self._emit(self.buf[:i])
                if self.route == "call":
                    out.append(Delta(content=CALL))
                self.buf = self.buf[i + len(tag) :]
                self.state = "between"
                continue
            keep = 0 if final else partial_suffix(self.buf, BODY_ENDS)
            out += self._emit(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
            return out
        return out


def template_effort(effort: ReasoningEffort) -> str:
    """The level the gpt-oss template prints (`Reasoning: …`): it knows low, medium and high. It cannot
    switch reasoning off, so none / minimal ask for its least; xhigh / max for its most."""
    if effort in (ReasoningEffort.NONE, ReasoningEffort.MINIMAL, ReasoningEffort.LOW):
        return "low"
    return "medium" if effort is ReasoningEffort.MEDIUM else "high"


def prepare_tools(tools: list[dict] | None) -> list[dict] | None:
    """The template prints every tool's `description` and fails without one: give absent ones ""."""
    if not tools:
        return tools
    return [{**t, "function": {"description": "", **t["function"]}} for t in tools]


def prepare_messages(messages: list[dict]) -> list[dict]:
    """Reshape prepared (OpenAI-style) messages for the gpt-oss template; a pure function of its input.

    Reasoning goes to `thinking` (the field the template reads). An assistant message with several tool
    calls becomes one message per call, each followed by its own result (matched by tool_call_id), since
    the template renders only a message's first call and names a result after the latest call."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        i += 1
        if m.get("role") != "assistant":
            out.append(m)
            continue
        m = dict(m)
        reasoning = m.pop("reasoning_content", None) or m.pop("reasoning", None)
        m.pop("reasoning", None)
        if reasoning:
            m["thinking"] = reasoning
        calls = m.get("tool_calls") or []
        if len(calls) <= 1:
            out.append(m)
            continue
        results: list[dict] = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        by_id = {r.get("tool_call_id"): r for r in results}
        for k, call in enumerate(calls):
            out.append({**m, "tool_calls": [call]} if k == 0 else {"role": "assistant", "content": "", "tool_calls": [call]})
            if (result := by_id.pop(call.get("id"), None)) is not None:
                out.append(result)
        out.extend(r for r in results if r.get("tool_call_id") in by_id)  # results naming no call: kept, last
    return out
